"""Paged varlen prefill attention (Triton) against ref_prefill_attention and a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import DTYPES, TOL, attention_f64, make_paged_case, poison_stale_slots, rel_err  # noqa: E402

from roofline.kernels.prefill_attention import paged_prefill_attention, ref_prefill_attention  # noqa: E402

# (q_lens, seq_lens): seq_len - q_len is the cached prefix each chunk extends.
CASES = {
    "one_token": ([1], [1]),
    "ragged_prefill": ([5, 17, 1, 33], [5, 17, 1, 33]),
    "chunked_extend": ([7, 16, 1, 20], [40, 16, 19, 52]),
    "block_boundaries": ([16, 32, 15], [32, 32, 33]),
}


def _check(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    q, kc, vc, meta = make_paged_case(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.full_like(q, float("nan"))  # poison: unwritten rows fail
    paged_prefill_attention(q, kc, vc, meta, scale, out=out)
    tol = TOL[dtype]
    err_ref = rel_err(out, ref_prefill_attention(q, kc, vc, meta, scale))
    err_f64 = rel_err(out.cpu(), attention_f64(q, kc, vc, meta, scale))
    assert err_ref < tol, f"vs ref_: {err_ref:.2e} >= {tol}"
    assert err_f64 < tol, f"vs float64: {err_f64:.2e} >= {tol}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size,group", [(16, 1), (1, 3), (32, 4)])
def test_prefill_matches_references(case, block_size, group, dtype):
    q_lens, seq_lens = CASES[case]
    _check(q_lens, seq_lens, 2 * group, 2, 64, block_size, dtype, seed=list(CASES).index(case) * 100 + block_size)


@pytest.mark.parametrize("head_dim", [32, 96, 128])
def test_prefill_head_dims(head_dim):
    # 96 is not a power of two: the kernel pads D to 128 and masks.
    _check([9, 3], [9, 21], 4, 2, head_dim, 16, torch.float32, seed=head_dim)


def test_prefill_longer_context_fp16():
    _check([24, 2], [300, 130], 4, 1, 64, 16, torch.float16, seed=7)


def test_prefill_rejects_bad_group():
    q, kc, vc, meta = make_paged_case([2], [2], 3, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_prefill_attention(q, kc, vc, meta, 0.125)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_dim,block_size,group", [(128, 16, 4), (64, 32, 1), (128, 256, 4), (256, 16, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_gpu_large(head_dim, block_size, group, dtype):
    # GPU tile configs (BLOCK_M 128 / BLOCK_N 64), long ragged chunks, a 4k prefix, a one-token chunk.
    q_lens = [1000, 1, 513, 2048, 77]
    seq_lens = [1000, 3000, 1024, 2048, 4100]
    _check(q_lens, seq_lens, 8 * group, 8, head_dim, block_size, dtype, seed=head_dim + block_size)



@pytest.mark.parametrize("config", [None] + ([dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, USE_TMA=True),
                                              dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3, USE_TMA=True)]
                                             if torch.cuda.is_available() else []))
def test_prefill_ignores_stale_cache_slots(config):
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    block_size = 256 if torch.cuda.is_available() else 32
    q_lens, seq_lens = [300, 1, 77], [300, 513, 1000]
    if not torch.cuda.is_available():
        q_lens, seq_lens = [20, 1, 7], [20, 45, 70]
    q, kc, vc, meta = make_paged_case(q_lens, seq_lens, 8, 2, 128 if torch.cuda.is_available() else 32,
                                      block_size, dtype, seed=11)
    poison_stale_slots(kc, vc, meta)
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, kc, vc, meta, scale, out=out, config=config)
    assert rel_err(out, ref_prefill_attention(q, kc, vc, meta, scale)) < TOL[dtype]
