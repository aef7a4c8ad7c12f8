"""TritonAttentionBackend against the exact TorchAttentionBackend: cache contents and outputs."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import DEVICE, DTYPES, TOL, make_paged_case, rel_err  # noqa: E402

from roofline.layers.attention import TorchAttentionBackend, get_attention_backend  # noqa: E402


def _run_both(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    q, kc, vc, meta = make_paged_case(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    k = torch.randn(q.shape[0], num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(q.shape[0], num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    backend = get_attention_backend("triton")(num_heads, num_kv_heads, head_dim)
    assert backend.name == "triton" and backend.scale == 1.0 / math.sqrt(head_dim)
    kc_t, vc_t = kc.clone(), vc.clone()
    out = backend.forward(q, k, v, kc_t, vc_t, meta)
    ref_backend = TorchAttentionBackend(num_heads, num_kv_heads, head_dim)
    ref = ref_backend.forward(q, k, v, kc, vc, meta)
    assert torch.equal(kc_t, kc) and torch.equal(vc_t, vc)  # same cache writes, bit for bit
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_mixed_prefill_and_decode(dtype):
    # chunked prefill sharing the step with two decodes
    _run_both([12, 1, 5, 1], [12, 30, 21, 17], 6, 2, 64, 16, dtype, seed=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_decode_only(dtype):
    _run_both([1, 1, 1], [1, 16, 45], 8, 2, 64, 16, dtype, seed=2)
