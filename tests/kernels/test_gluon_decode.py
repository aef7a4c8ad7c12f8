"""The Gluon split-KV decode kernel for int8 / fp8 e4m3 KV caches (``roofline.kernels.gluon_decode``; issue 29).

GPU (sm_80+; the default ``auto`` choice only on sm_90): outputs against the float64 oracle on the DEQUANTIZED
cache (codes x scales in float64) and against ``ref_decode_attention`` at several (batch, context, block size,
splits, cache format, head_dim, GQA group), stale slots poisoned (NaN fp8 codes, int8 NaN scales); the default
dispatch picking it; a CUDA-graph capture and replay. CPU: the dispatch's choice and errors (no kernel runs).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import (  # noqa: E402
    attention_f64,
    make_paged_case,
    poison_stale_quantized,
    quantize_cache,
    rel_err,
)

from roofline.kernels.common import KV_QUANT_PER_TOKEN  # noqa: E402
from roofline.kernels.decode_attention import paged_decode_attention, ref_decode_attention  # noqa: E402
from roofline.kernels.gluon_decode import (  # noqa: E402
    DECODE_KERNEL_ENV,
    decode_kernel_choice,
    gluon_config_reason,
    gluon_decode_unsupported_reason,
)

GLUON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8


def gpu_test(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not GLUON_GPU, reason="needs an sm_80+ CUDA GPU")(fn))


# bf16 q, products in fp16, fp32 softmax: the same bound as the Triton kernels' bf16 cases (kernel_cases.TOL).
TOL_BF16 = 1e-2


def _dequantized_f64(codes, scale):
    s = scale.double()
    return codes.double() * (s[:, None] if s.dim() == 1 else s.unsqueeze(-1))


def _case(fmt, seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed, dtype=torch.bfloat16):
    q, kc, vc, meta = make_paged_case([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim,
                                      block_size, dtype, seed)
    kc, vc, ks, vs = quantize_cache(kc, vc, fmt)
    poison_stale_quantized(kc, vc, meta, ks, vs)
    return q, kc, vc, ks, vs, meta


def _errors(out, q, kc, vc, ks, vs, meta):
    scale = 1.0 / math.sqrt(q.shape[2])
    ref = ref_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, scale, k_scale=ks, v_scale=vs)
    oracle = attention_f64(q, _dequantized_f64(kc, ks), _dequantized_f64(vc, vs), meta, scale)
    return rel_err(out, ref), rel_err(out.cpu(), oracle)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("seq_lens,block_size,num_splits,heads,head_dim", [
    ([1, 17, 64, 200], 16, 3, (32, 8), 128),  # a 1-key sequence, a page boundary inside a tile, empty splits
    ([300, 65, 1000], 64, 4, (16, 4), 64),  # pages of one tile; split boundaries off tile boundaries
    ([513, 129], 128, 2, (16, 2), 128),  # pages of two tiles; GQA group 8 (N of the MMA full)
    ([2000], 16, 1, (8, 8), 64),  # one split of 32 tiles of 4 pages; MHA (group 1)
    ([4097, 33, 700, 1], 64, 8, (32, 8), 128),  # the bench's shape
])
@gpu_test
def test_gluon_decode_matches_float64(fmt, seq_lens, block_size, num_splits, heads, head_dim):
    q, kc, vc, ks, vs, meta = _case(fmt, seq_lens, *heads, head_dim, block_size, seed=len(seq_lens) + block_size)
    out = torch.full_like(q, float("nan"))  # poison: unwritten rows fail
    paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, 1.0 / math.sqrt(head_dim), out=out,
                           num_splits=num_splits, k_scale=ks, v_scale=vs, variant="gluon")
    err_ref, err_f64 = _errors(out, q, kc, vc, ks, vs, meta)
    assert err_ref < TOL_BF16, f"gluon {fmt} vs ref_decode_attention: {err_ref:.2e} >= {TOL_BF16}"
    assert err_f64 < TOL_BF16, f"gluon {fmt} vs float64: {err_f64:.2e} >= {TOL_BF16}"


@pytest.mark.parametrize("fmt,block_n,num_warps,num_stages,block_size", [
    ("int8", 16, 1, 2, 8), ("fp8_e4m3", 64, 1, 1, 64), ("int8", 32, 2, 2, 16), ("fp8_e4m3", 64, 4, 1, 128)])
@gpu_test
def test_gluon_decode_tiles(fmt, block_n, num_warps, num_stages, block_size):
    """The tiles ``roofline bench attention --configs`` sweeps (num_stages 1: no register prefetch), default splits."""
    q, kc, vc, ks, vs, meta = _case(fmt, [1000, 37, 2500], 32, 8, 128, block_size, seed=block_n + num_warps)
    out = paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, 1.0 / math.sqrt(128), k_scale=ks,
                                 v_scale=vs, variant="gluon", block_n=block_n, num_warps=num_warps,
                                 num_stages=num_stages)
    err_ref, err_f64 = _errors(out, q, kc, vc, ks, vs, meta)
    assert err_ref < TOL_BF16 and err_f64 < TOL_BF16, (err_ref, err_f64)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@gpu_test
def test_gluon_decode_fp16_q_and_default_dispatch(fmt, monkeypatch):
    """fp16 q; the default (variant None) with ROOFLINE_DECODE_KERNEL=gluon equals variant='gluon' bit for bit,
    and =triton equals the Triton 'mma' variant bit for bit."""
    q, kc, vc, ks, vs, meta = _case(fmt, [777, 90, 1500], 32, 8, 128, 16, seed=3, dtype=torch.float16)
    args = (q, kc, vc, meta.block_tables, meta.seq_lens, 1.0 / math.sqrt(128))
    kw = dict(num_splits=4, k_scale=ks, v_scale=vs)
    explicit = paged_decode_attention(*args, variant="gluon", **kw)
    err_ref, err_f64 = _errors(explicit, q, kc, vc, ks, vs, meta)
    assert err_ref < 1e-2 and err_f64 < 1e-2, (err_ref, err_f64)
    monkeypatch.setenv(DECODE_KERNEL_ENV, "gluon")
    assert torch.equal(paged_decode_attention(*args, **kw), explicit)
    monkeypatch.setenv(DECODE_KERNEL_ENV, "triton")
    assert torch.equal(paged_decode_attention(*args, **kw), paged_decode_attention(*args, variant="mma", **kw))


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@gpu_test
def test_gluon_decode_cuda_graph(fmt):
    """Captured once, replayed with new queries and longer contexts in the same buffers: equal to eager."""
    q, kc, vc, ks, vs, meta = _case(fmt, [500, 1200, 64, 3000], 32, 8, 128, 64, seed=11)
    scale = 1.0 / math.sqrt(128)
    out = torch.empty_like(q)
    kw = dict(num_splits=8, k_scale=ks, v_scale=vs, variant="gluon", out=out)
    paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, scale, **kw)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, scale, **kw)
    q.copy_(torch.randn_like(q))
    # Shorter contexts (the slots past the capture's lengths are poisoned, so the replay must not read them).
    meta.seq_lens.copy_(torch.tensor([400, 1100, 1, 2900], dtype=torch.int32, device=q.device))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    eager = paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, scale, num_splits=8, k_scale=ks,
                                   v_scale=vs, variant="gluon")
    assert torch.equal(replayed, eager)
    assert torch.isfinite(replayed).all()


def test_decode_kernel_choice(monkeypatch):
    monkeypatch.delenv(DECODE_KERNEL_ENV, raising=False)
    assert decode_kernel_choice() == "auto"
    monkeypatch.setenv(DECODE_KERNEL_ENV, " Triton ")
    assert decode_kernel_choice() == "triton"
    assert decode_kernel_choice("gluon") == "gluon"
    monkeypatch.setenv(DECODE_KERNEL_ENV, "cuda")
    with pytest.raises(ValueError, match="ROOFLINE_DECODE_KERNEL='cuda'; allowed: auto, triton, gluon"):
        decode_kernel_choice()


def test_gluon_decode_unsupported_reasons_cpu():
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    kc = torch.zeros(4, 16, 2, 128, dtype=torch.int8)
    reason = gluon_decode_unsupported_reason(q, kc, kc, KV_QUANT_PER_TOKEN, 1)
    assert reason is not None and ("cpu" in reason or "gluon" in reason)
    assert gluon_decode_unsupported_reason(q, kc, kc, KV_QUANT_PER_TOKEN, 1, "triton") is not None
    seq_lens = torch.tensor([5, 7], dtype=torch.int32)
    tables = torch.zeros(2, 1, dtype=torch.int32)
    ks = torch.ones(4, 16, 2)
    with pytest.raises(ValueError, match="decode variant 'gluon' cannot run this call"):
        paged_decode_attention(q, kc, kc, tables, seq_lens, 0.1, k_scale=ks, v_scale=ks, variant="gluon")
    assert gluon_config_reason(64, 4, 128) is None and gluon_config_reason(16, 1, 64) is None
    assert "block_n 48 x num_warps 2" in gluon_config_reason(48, 2, 128)
    assert gluon_config_reason(128, 8, 64) is not None  # head_dim 64 < 16 x 8 rows of O^T
