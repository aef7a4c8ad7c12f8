"""The small-M fp32 linear on CPU (``roofline.kernels.cpu_f32``): within a stated error of float64 at every row
count it takes, each row's result independent of the rows beside it (bit-identical), the engine's fp32 linears,
LM head and EAGLE fc routed through it at decode and verify sizes, and None (the caller's F.linear) where it does
not apply."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from roofline.cpu import detect_cpu_features
from roofline.kernels import cpu_bf16, cpu_f32
from roofline.kernels.cpu_paged_attention import unavailable_reason

needs_linear = pytest.mark.skipif(unavailable_reason() is not None or not cpu_f32.available(),
                                  reason="needs the C++ kernel library built with AVX-512F or AVX2 + FMA")

# The default model's linear shapes [N, K] (qkv, o, gate_up, down), an N with a tail of 3 rows, the smallest K.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (1027, 96), (5, 16)]


@needs_linear
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 17, cpu_f32.MAX_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_f32_matches_float64_and_rows_do_not_depend_on_m(n, k, m, with_bias):
    gen = torch.Generator().manual_seed(n * 100 + m)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    got = cpu_f32.linear_f32(x, w, bias)
    assert got is not None and got.shape == (m, n) and got.dtype == torch.float32
    ref = x.double() @ w.double().t() + (bias.double() if with_bias else 0)
    # Per output, Higham's bound for fp32 summation of K products and the bias: |error| <= (K + 2) u sum |terms|,
    # u = 2^-24 (the 16 lanes only shorten the chains).
    terms = x.double().abs() @ w.double().abs().t() + (bias.double().abs() if with_bias else 0)
    assert ((got.double() - ref).abs() <= (k + 2) * 2.0 ** -24 * terms).all()
    # One row at a time gives the same bits: a verify pass's rows equal decode steps' single rows.
    single = torch.cat([cpu_f32.linear_f32(x[i:i + 1], w, bias) for i in range(m)])
    assert torch.equal(got, single)


@needs_linear
def test_linear_f32_declines_what_it_does_not_take(monkeypatch):
    w, x = torch.randn(32, 48), torch.randn(2, 48)
    assert cpu_f32.linear_f32(x, w) is not None
    assert cpu_f32.linear_f32(torch.randn(2, 40), torch.randn(32, 40)) is None  # K % 16
    assert cpu_f32.linear_f32(torch.randn(cpu_f32.MAX_ROWS + 1, 48), w) is None  # past MAX_ROWS: MKL's sgemm
    assert cpu_f32.linear_f32(torch.randn(0, 48), w) is None
    assert cpu_f32.linear_f32(x.bfloat16(), w.bfloat16()) is None
    assert cpu_f32.linear_f32(x, torch.randn(48, 32).t()) is None  # a transposed (non-contiguous) weight
    assert cpu_f32.linear_f32(x, w, torch.randn(31)) is None  # a bias of the wrong length
    monkeypatch.setattr(cpu_bf16, "GEMV", False)  # ROOFLINE_CPU_GEMV=0
    assert cpu_f32.linear_f32(x, w) is None
    assert torch.equal(cpu_f32.cpu_linear(x, w), F.linear(x, w))


@needs_linear
def test_linear_f32_keeps_leading_dims():
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(64, 32, generator=gen), torch.randn(2, 3, 32, generator=gen)
    got = cpu_f32.linear_f32(x, w)
    assert got.shape == (2, 3, 64)
    assert torch.equal(got, cpu_f32.linear_f32(x.reshape(6, 32), w).reshape(2, 3, 64))


@needs_linear
def test_engine_fp32_linears_and_head_take_it_at_decode_sizes(monkeypatch):
    """Every fp32 linear of the default model and its LM head run the loop at 1 and 4 rows (a decode step, a
    verify pass) and F.linear past MAX_ROWS; greedy tokens are those of the engine with it off."""
    from roofline import LLM, SamplingParams
    from roofline.layers.linear import LinearBase

    llm = LLM(device="cpu", dtype="float32", max_model_len=256, attention_backend="torch")
    model = llm.engine.worker.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 4 * 30
    for layer in linears[:4] + [model.lm_head]:
        for m in (1, 4, cpu_f32.MAX_ROWS + 1):
            x = torch.randn(m, layer.weight.shape[1])
            out = cpu_f32.layer_linear(layer, x)
            assert (out is not None) == (m <= cpu_f32.MAX_ROWS)
            if out is not None:
                assert torch.equal(out, cpu_f32.linear_f32(x, layer.weight))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    on = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setattr(cpu_bf16, "GEMV", False)
    off = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert on == off


@pytest.mark.skipif(not detect_cpu_features().avx2_fma or shutil.which("g++") is None,
                    reason="needs an x86 CPU with AVX2 + FMA and g++")
@pytest.mark.parametrize("n,k", [(960, 576), (1027, 96), (5, 16)])
def test_avx2_build_matches_float64_and_rows_do_not_depend_on_m(avx2_library, n, k):
    """The AVX2 + FMA loop (8-lane accumulators, x in chunks of two rows): the same error bound and M-independence
    as the AVX-512 loop."""
    import ctypes

    lib = avx2_library

    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(cpu_f32.MAX_ROWS, k, generator=gen)
    bias = torch.randn(n, generator=gen)

    def linear(x, w):
        y = torch.empty(x.shape[0], w.shape[0])
        assert lib.roofline_linear_f32(x.data_ptr(), w.data_ptr(), bias.data_ptr(), y.data_ptr(), x.shape[0],
                                       w.shape[0], k, ctypes.c_int(2)) == 1
        return y

    got = linear(x, w)
    ref = x.double() @ w.double().t() + bias.double()
    terms = x.double().abs() @ w.double().abs().t() + bias.double().abs()
    assert ((got.double() - ref).abs() <= (k + 2) * 2.0 ** -24 * terms).all()
    for m in (1, 2, 3, 5):
        assert torch.equal(linear(x[:m].contiguous(), w), got[:m])
    assert torch.equal(torch.cat([linear(x[i:i + 1].contiguous(), w) for i in range(7)]), got[:7])
