"""The L2 weight prefetch launched between RoPE + KV store and decode attention (issue 28), so that it streams
during attention only and does not compete with qkv's weight stream: ``LinearBase.prefetch_l2`` is patched to
queue its tensor, and the Triton backend's ``paged_decode_attention`` to launch the queue first. Then runs
``roofline bench decode`` with the given argv. Usage: PYTHONPATH=. python bench/gpu_l2_before_attention.py
--model llama-3-8b --batch-sizes 1 --contexts 1k --quantization int4 --l2-prefetch 0,o_proj:64line"""

from __future__ import annotations

import sys

from roofline.attention import triton_backend
from roofline.kernels import l2_prefetch, linear_dispatch
from roofline.layers.linear import LinearBase

queue = []


def queued_prefetch(self, num_tokens, where=""):
    if l2_prefetch.enabled(num_tokens, self.prefix.rsplit(".", 1)[-1] + (f"@{where}" if where else "")):
        t = linear_dispatch.streamed_weight(self, num_tokens)
        if t is not None:
            queue.append(t)


real_attention = triton_backend.paged_decode_attention


def attention_after_prefetch(*args, **kwargs):
    while queue:
        l2_prefetch.prefetch(queue.pop(0))
    return real_attention(*args, **kwargs)


LinearBase.prefetch_l2 = queued_prefetch
triton_backend.paged_decode_attention = attention_after_prefetch

if __name__ == "__main__":
    from roofline.cli import main

    sys.exit(main(["bench", "decode", *sys.argv[1:]]))
