"""TritonAttentionBackend against the exact TorchAttentionBackend: RoPE, cache contents and outputs."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import DEVICE, DTYPES, TOL, backend_with_cache, make_paged_case, positions_of, rel_err  # noqa: E402


def _run_both(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    q, kc, vc, meta = make_paged_case(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    k = torch.randn(q.shape[0], num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(q.shape[0], num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    pos = positions_of(meta)
    triton_b = backend_with_cache("triton", num_heads, num_kv_heads, head_dim, kc, vc)
    torch_b = backend_with_cache("torch", num_heads, num_kv_heads, head_dim, kc, vc)
    assert triton_b.name == "triton" and triton_b.scale == 1.0 / math.sqrt(head_dim)
    out = triton_b.forward(q.clone(), k.clone(), v, pos, triton_b.kv_cache(0), triton_b.build_metadata(meta))
    ref = torch_b.forward(q.clone(), k.clone(), v, pos, torch_b.kv_cache(0), torch_b.build_metadata(meta))
    # Same cache writes: bit for bit for v (a copy), within rounding for the rotated k.
    assert torch.equal(triton_b.kv_cache(0).v, torch_b.kv_cache(0).v)
    assert rel_err(triton_b.kv_cache(0).k, torch_b.kv_cache(0).k) < TOL[dtype]
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_mixed_prefill_and_decode(dtype):
    # chunked prefill sharing the step with two decodes
    _run_both([12, 1, 5, 1], [12, 30, 21, 17], 6, 2, 64, 16, dtype, seed=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_decode_only(dtype):
    _run_both([1, 1, 1], [1, 16, 45], 8, 2, 64, 16, dtype, seed=2)
