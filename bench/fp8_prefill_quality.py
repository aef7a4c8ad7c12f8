"""Quality of the FP8 prefill kernel's arithmetic on the real default model, on the CPU (issue 29).

The Gluon FP8 kernel (``gluon_prefill_kernel_fp8``) runs only on sm_90, and the GPU device cannot load the default
model's GGUF and the held-out ShareGPT slice in one call. Its arithmetic is emulated here instead. Every prefill
chunk over an fp8_e4m3 cache in the torch backend goes through ``ref_prefill_attention_fp8``'s rounding points:
q per (token, head) to E4M3, P as e4m3(P * 448), tiles of 64 keys, and the row sum of the unrounded P. This is
the kernel's numerics, not its bits. Decode rows keep the exact path, since on the GPU the decode kernel takes
them with a bf16 q.

It runs ``roofline eval`` (perplexity, KL and top-1 agreement against the baseline on the held-out ShareGPT
slice, plus greedy agreement) in two configurations:

    python bench/fp8_prefill_quality.py exact     [eval args]  # fp8_e4m3 KV, prefill on the codes in fp32
    python bench/fp8_prefill_quality.py kernel    [eval args]  # prefill with the FP8 kernel's roundings (q: 2 terms)
    python bench/fp8_prefill_quality.py kernel-1q [eval args]  # the same with q as one E4M3 term (Q_SPLIT False)
    python bench/fp8_prefill_quality.py kernel-p  [eval args]  # P's rounding only (q exact)

With --candidates kv_cache_dtype=fp8_e4m3, the baseline in both runs is the same unquantized-cache engine.
"""

from __future__ import annotations

import sys

import torch.nn.functional as F

from roofline.attention import torch_backend
from roofline.kernels.act_quant import ref_per_token_quant_fp8_split
from roofline.kernels.gluon_prefill import default_gluon_fp8_config, ref_fp8_attention_tiles
from roofline.kernels.prefill_attention import LOG2E

# The kernel's default tile of keys. The committed results (bench/results/fp8-prefill-quality-cpu-20261207/) ran
# with 64-key tiles, the default then; the tile only moves the running max P is rounded against.
BLOCK_N = default_gluon_fp8_config(128, 16)["BLOCK_N"]
ROUND = {"q": True, "p": True, "split": True}  # which roundings a mode applies


def emulated_sdpa(q, k, v, attn_mask=None, scale=None, enable_gqa=False, **kw):
    """SDPA over already-dequantized K/V ([H_kv, L, D]) with the FP8 kernel's roundings
    (``ref_fp8_attention_tiles``); 3-D calls only (the torch backend's prefill chunks over a quantized cache);
    anything else runs torch's SDPA."""
    if q.dim() != 3 or attn_mask is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa, **kw)
    h, n_q, d = q.shape
    group = h // k.shape[0]
    k, v = k.repeat_interleave(group, 0).float(), v.repeat_interleave(group, 0).float()
    qd = q.float()
    if ROUND["q"]:  # rows (head, token): the same per-row rule as per (token, head)
        hi, lo, qs = ref_per_token_quant_fp8_split(qd)
        codes = hi.float() + lo.float() if ROUND["split"] else hi.float()
        qd = (codes * qs).view(h, n_q, d)  # the values the kernel's codes stand for
    o = ref_fp8_attention_tiles(qd, k, v, attn_mask, scale * LOG2E, BLOCK_N, round_p=ROUND["p"])
    return o.to(q.dtype)


class _FShim:
    """torch.nn.functional with scaled_dot_product_attention replaced (the backend's module-level ``F``)."""

    def __getattr__(self, name):
        return emulated_sdpa if name == "scaled_dot_product_attention" else getattr(F, name)


def main() -> int:
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode not in ("exact", "kernel", "kernel-1q", "kernel-p"):
        raise SystemExit("first argument: exact, kernel (q in two E4M3 terms), kernel-1q (q in one) or kernel-p "
                         "(P rounded only)")
    ROUND.update(q=mode != "kernel-p", split=mode != "kernel-1q")
    if mode != "exact":
        torch_backend.F = _FShim()
    from roofline.cli import main as cli_main

    return cli_main(["eval", *rest])


if __name__ == "__main__":
    sys.exit(main())
