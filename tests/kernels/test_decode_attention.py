"""Split-KV paged decode attention (Triton) against ref_decode_attention and a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import DTYPES, TOL, attention_f64, make_paged_case, poison_stale_slots, rel_err  # noqa: E402

from roofline.kernels.decode_attention import paged_decode_attention, ref_decode_attention  # noqa: E402


def _check(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits, seed, block_n=None):
    q, kc, vc, meta = make_paged_case([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim,
                                      block_size, dtype, seed)
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.full_like(q, float("nan"))  # poison: unwritten rows fail
    paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, scale, num_splits=num_splits, out=out,
                           block_n=block_n)
    tol = TOL[dtype]
    err_ref = rel_err(out, ref_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, scale))
    # The decode query is the last token of each sequence: the prefill float64 reference covers it.
    err_f64 = rel_err(out.cpu(), attention_f64(q, kc, vc, meta, scale))
    assert err_ref < tol, f"vs ref_: {err_ref:.2e} >= {tol}"
    assert err_f64 < tol, f"vs float64: {err_f64:.2e} >= {tol}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,group", [(16, 1), (1, 3), (32, 4)])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_matches_references(block_size, group, num_splits, dtype):
    # ragged: 1 token, block-boundary lengths, and lengths shorter than num_splits tiles (empty splits).
    seq_lens = [1, 16, 33, 64, 100]
    _check(seq_lens, 2 * group, 2, 64, block_size, dtype, num_splits, seed=block_size * 10 + num_splits,
           block_n=16)


@pytest.mark.parametrize("head_dim", [32, 96, 128])
def test_decode_head_dims(head_dim):
    _check([5, 70], 4, 2, head_dim, 16, torch.float32, num_splits=2, seed=head_dim, block_n=16)


def test_decode_longer_context_fp16_default_splits():
    _check([700, 257], 4, 1, 64, 16, torch.float16, num_splits=None, seed=3, block_n=32)


def test_decode_zero_length_row_is_zero():
    # A padded CUDA-graph row (seq_len 0) must give zeros, not NaN.
    q, kc, vc, meta = make_paged_case([1, 1], [5, 1], 4, 2, 32, 16, torch.float32)
    seq_lens = meta.seq_lens.clone()
    seq_lens[1] = 0
    out = paged_decode_attention(q, kc, vc, meta.block_tables, seq_lens, 0.2, num_splits=2, block_n=16)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = ref_decode_attention(q[:1], kc, vc, meta.block_tables[:1], seq_lens[:1], 0.2)
    assert rel_err(out[:1], ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_dim,block_size,group", [(128, 16, 4), (64, 32, 1), (128, 256, 4), (256, 16, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_gpu_large(head_dim, block_size, group, dtype):
    # GPU tile config (BLOCK_N 64), default num_splits, contexts up to 9k.
    _check([1, 4097, 9000, 300, 2048], 8 * group, 8, head_dim, block_size, dtype, num_splits=None,
           seed=head_dim + block_size)


def test_decode_ignores_stale_cache_slots():
    q, kc, vc, meta = make_paged_case([1, 1, 1], [1, 47, 200], 8, 2, 64, 32, torch.float32, seed=12)
    poison_stale_slots(kc, vc, meta)
    out = paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125, num_splits=4, block_n=16)
    assert rel_err(out, ref_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125)) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits,head_dim,group", [(1, 64, 4), (2, 64, 4), (5, 64, 3), (32, 128, 4)])
def test_fused_reduction_matches_the_reduce_kernel(monkeypatch, num_splits, head_dim, group, dtype):
    # The "old" kernel's last-arrival reduction (FUSED_REDUCE) against the separate _decode_reduce_kernel on the same
    # partials: equal up to the order of one fp32 sum, and the arrival counters back at 0 after every call. A group of
    # 3 pads to 4 rows; 32 splits at D 128 merge in 4 chunks of 8 (RED_SPLITS), most of them empty for the short rows.
    import roofline.kernels.decode_attention as da
    from roofline.kernels.splitk import arrival_counters

    q, kc, vc, meta = make_paged_case([1] * 4, [1, 40, 97, 3] if num_splits < 32 else [1, 700, 390, 3], 2 * group, 2,
                                      head_dim, 16, dtype, seed=num_splits)
    outs = {}
    for fused in (False, True, True):  # the second fused call runs on the counters the first one re-armed
        monkeypatch.setattr(da, "FUSED_REDUCE", fused)
        outs.setdefault(fused, []).append(paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125,
                                                                 num_splits=num_splits, block_n=16, variant="old"))
        assert int(arrival_counters(q.device, 1).abs().sum()) == 0
    assert torch.equal(outs[True][0], outs[True][1])
    tol = 1e-6 if dtype == torch.float32 else TOL[dtype]
    assert rel_err(outs[True][0], outs[False][0]) < tol
    ref = ref_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125)
    assert rel_err(outs[True][0], ref) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_reduction_replays_in_a_cuda_graph():
    # Counters re-armed inside the graph: every replay equals the eager call, bit for bit.
    q, kc, vc, meta = make_paged_case([1] * 8, [1, 4097, 900, 30, 2048, 64, 5000, 700], 32, 8, 128, 16,
                                      torch.bfloat16, seed=5)
    eager = paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, 0.088)
    out = torch.empty_like(q)
    paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, 0.088, out=out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, 0.088, out=out)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_outgrown_arrival_counters_stay_alive():
    # A CUDA graph captured with the old buffer keeps replaying its atomics on it: growing must not free it.
    import weakref

    from roofline.kernels.splitk import arrival_counters

    dev = torch.device("cpu")
    old = arrival_counters(dev, 64)
    ref = weakref.ref(old)
    new = arrival_counters(dev, old.numel() + 1)
    assert new.numel() > old.numel() and new.data_ptr() != old.data_ptr()
    del old
    assert ref() is not None and int(ref().abs().sum()) == 0
    assert arrival_counters(dev, 8) is new
