"""Programmatic dependent launch (roofline.kernels.pdl): off where the device lacks it, and on an sm_90 GPU a
chain of PDL-launched kernels captured in one CUDA graph gives bit-identical results to the same chain without
PDL (PDL changes when a kernel starts, never its arithmetic; a missing wait would read stale inputs)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from roofline.kernels import pdl  # noqa: E402


def test_pdl_is_off_without_the_hardware(monkeypatch):
    monkeypatch.setattr(pdl, "MODE", 2)
    cpu = torch.device("cpu")
    assert pdl.mode(cpu) == 0 and pdl.launch_kwargs(cpu) == {}
    assert pdl.mode(cpu, override=1) == 0


def _graphed(chain):
    """``chain()``'s output from one replay of a CUDA graph that captured it (after a warm-up run on a side
    stream, as torch's capture recipe asks)."""
    from roofline.worker.cuda_graph import capture_graph

    graph, out = capture_graph(chain)
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a GPU with programmatic dependent launch (sm_90+)")
@pytest.mark.parametrize("mode", [1, 2])
def test_gpu_pdl_chain_in_a_cuda_graph_is_bit_identical(monkeypatch, mode):
    from roofline.kernels import quant_gemm as qg
    from roofline.kernels.activation import silu_and_mul
    from roofline.kernels.rmsnorm import fused_add_rmsnorm
    from roofline.quant.quantize import quantize_int4_rtn

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter = 1024, 2816
    x = torch.randn(1, hidden, device="cuda", generator=g).bfloat16()
    res = torch.randn(1, hidden, device="cuda", generator=g).bfloat16()
    wn = torch.rand(hidden, device="cuda", generator=g).bfloat16() + 0.5
    w_up = (torch.randn(2 * inter, hidden, device="cuda", generator=g) * 0.03).bfloat16()
    p4 = qg.prepare_int4(quantize_int4_rtn(torch.randn(hidden, inter, device="cuda", generator=g) * 0.03, 128),
                         torch.bfloat16)
    one_row = qg.GemmConfig(1, 8, 256, 4, 1, gemv=True)
    int4_row = qg.GemmConfig(1, 64, 128, 4, 1, split_k=4, gemv=True)

    def chain():
        h, r = fused_add_rmsnorm(x, res, wn, 1e-5)
        for _ in range(4):  # a GEMV reading the norm's output, the activation reading the GEMV's, and back
            a = silu_and_mul(qg.dense_gemv(h, w_up, config=one_row))
            h, r = fused_add_rmsnorm(qg.w4a16_gemm(a, p4.qweight, p4.scales, p4.zeros, 128, config=int4_row), r,
                                     wn, 1e-5)
        return h

    monkeypatch.setattr(pdl, "MODE", 0)
    want = _graphed(chain)
    monkeypatch.setattr(pdl, "MODE", mode)
    got = _graphed(chain)
    assert torch.isfinite(want).all() and torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a GPU with programmatic dependent launch (sm_90+)")
def test_gpu_pdl_attention_chain_in_a_cuda_graph_is_bit_identical(monkeypatch):
    """RoPE + cache store -> split-KV decode attention (split and reduce kernels) -> a GEMV of its output, four
    layers over one bf16 cache, in one CUDA graph: PDL on gives the same bits as PDL off (a missing wait in the
    attention kernels would read the previous layer's q or a stale cache row)."""
    from roofline.kernels import quant_gemm as qg
    from roofline.kernels.decode_attention import paged_decode_attention
    from roofline.kernels.rope_cache import rope_and_cache

    g = torch.Generator(device="cuda").manual_seed(1)
    heads, kv_heads, dim, block, ctx = 8, 2, 128, 16, 300
    hidden = heads * dim
    cache_k = torch.randn(64, block, kv_heads, dim, device="cuda", generator=g).bfloat16()
    cache_v = torch.randn(64, block, kv_heads, dim, device="cuda", generator=g).bfloat16()
    tables = torch.randperm(64, device="cuda", generator=g)[:32].int().view(1, 32)
    seq_lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    pos = torch.tensor([ctx - 1], device="cuda")
    slot = (tables[0, (ctx - 1) // block].long() * block + (ctx - 1) % block).view(1)
    cos_sin = torch.randn(ctx, dim, device="cuda", generator=g)
    w_qkv = (torch.randn((heads + 2 * kv_heads) * dim, hidden, device="cuda", generator=g) * 0.03).bfloat16()
    x0 = torch.randn(1, hidden, device="cuda", generator=g).bfloat16()
    one_row = qg.GemmConfig(1, 8, 256, 4, 1, gemv=True)

    def chain():
        x = x0
        for _ in range(4):
            qkv = qg.dense_gemv(x, w_qkv, config=one_row)
            q, k, v = qkv.split([hidden, kv_heads * dim, kv_heads * dim], dim=-1)
            q, k, v = q.reshape(1, heads, dim), k.reshape(1, kv_heads, dim), v.reshape(1, kv_heads, dim)
            rope_and_cache(q, k, v, pos, cos_sin, cache_k, cache_v, slot)
            x = paged_decode_attention(q, cache_k, cache_v, tables, seq_lens, dim ** -0.5).reshape(1, hidden)
        return x

    monkeypatch.setattr(pdl, "MODE", 0)
    want = _graphed(chain)
    monkeypatch.setattr(pdl, "MODE", 1)
    got = _graphed(chain)
    assert torch.isfinite(want).all() and torch.equal(got, want)
