"""bf16 linears on CPU with weights packed once after loading (``roofline.kernels.cpu_bf16``: tiles for the AMX or
the AVX-512 BF16 small-M GEMM where the CPU has either, else oneDNN's layout): the same products as ``F.linear``
within bf16 rounding and within one bf16 rounding of float64, for every linear and the 16-bit LM head, rows that do
not depend on the rows beside them, and the same greedy tokens as the unpacked engine on the default model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from roofline.kernels import cpu_bf16

pytestmark = pytest.mark.skipif(not cpu_bf16._cpu_has_bf16_units(),
                                reason="needs a CPU with AVX-512 BF16 or AMX-BF16 (oneDNN's bf16 units)")

# The default model's linear shapes [N, K] (qkv, o, gate_up, down, the LM head).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 7, 32])
def test_packed_linear_matches_f_linear_and_float64(n, k, m):
    gen = torch.Generator().manual_seed(n + m)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(2, m, k, generator=gen).bfloat16()  # a leading batch dim: reshaped and restored
    bias = torch.randn(n, generator=gen).bfloat16()
    got = cpu_bf16.packed_linear(x, cpu_bf16.prepack(w), bias)
    want = F.linear(x, w, bias)
    assert got.shape == want.shape == (2, m, n) and got.dtype == torch.bfloat16
    # Within one bf16 rounding of the output (2^-8 relative): both round the same fp32 accumulation (on the
    # Xeon of 2026-12-04 they were bit-identical, the same oneDNN kernel).
    ref = (x.double() @ w.double().t() + bias.double())
    tol = ref.abs().amax().item() * 2.0 ** -7
    assert (got.double() - want.double()).abs().max().item() <= tol
    assert (got.double() - ref).abs().max().item() <= tol


def test_prepack_only_bf16_on_cpu_and_switchable(monkeypatch):
    assert cpu_bf16.should_prepack(torch.zeros(4, 8, dtype=torch.bfloat16))
    assert not cpu_bf16.should_prepack(torch.zeros(4, 8))  # fp32: no gain measured
    assert not cpu_bf16.should_prepack(torch.zeros(4, 8, dtype=torch.float16))
    monkeypatch.setattr(cpu_bf16, "PREPACK", False)
    assert not cpu_bf16.should_prepack(torch.zeros(4, 8, dtype=torch.bfloat16))


def _engine(prepack: bool):
    from roofline import LLM

    old = cpu_bf16.PREPACK
    cpu_bf16.PREPACK = prepack  # read when the weights are processed after loading
    try:
        return LLM(device="cpu", dtype="bfloat16", max_model_len=256, attention_backend="torch")
    finally:
        cpu_bf16.PREPACK = old


def test_engine_packs_every_linear_and_the_head_and_keeps_greedy_tokens():
    from roofline import SamplingParams
    from roofline.layers.linear import LinearBase
    from roofline.layers.vocab_embedding import ParallelLMHead

    packed, plain = _engine(True), _engine(False)
    model = packed.engine.worker.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 4 * 30  # qkv, o, gate_up, down per layer
    tiles = cpu_bf16.tiles_available()  # tiles [N/16, K/32, 16, 32], else oneDNN's opaque [N, K]
    assert all(m.packed_weight is not None and m.packed_weight.numel() == m.weight.numel()
               and m.packed_weight.dim() == (4 if tiles else 2) for m in linears)
    head = next(m for m in model.modules() if isinstance(m, ParallelLMHead))
    assert head.packed_weight is not None
    assert all(m.packed_weight is None for m in plain.engine.worker.model.modules() if isinstance(m, LinearBase))
    # The floor counts the dense weights once (the packed copies are the same bytes, read instead).
    assert packed.engine.worker.weight_bytes_per_step == plain.engine.worker.weight_bytes_per_step
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, sp, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    assert got == want


needs_tiles = pytest.mark.skipif(not cpu_bf16.tiles_available(),
                                 reason="needs AVX-512 BF16 or AMX-BF16 and the C++ library")
needs_vnni = pytest.mark.skipif(not cpu_bf16.vnni_available(), reason="needs AVX-512 BF16 and the C++ library")
needs_amx = pytest.mark.skipif(not cpu_bf16.amx_available(), reason="needs AMX-BF16 and the C++ library")


@needs_tiles
@pytest.mark.parametrize("n,k", SHAPES + [(48, 64), (16, 96)])  # 48 / 16: a last block of 16 columns
def test_one_row_matches_float64(n, k):
    """One row (a decode step) through packed_linear: fp32 accumulation of exact bf16 products, rounded once to
    bf16, so within one bf16 rounding (2^-8 of the largest output) of the float64 product, bias added in fp32."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(1, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    ref = x.double() @ w.double().t() + bias.double()
    packed = cpu_bf16.prepack(w)
    assert packed.dim() == 4
    got = cpu_bf16.packed_linear(x.reshape(1, 1, k), packed, bias, dense=w).reshape(1, n)
    assert got.shape == (1, n) and got.dtype == torch.bfloat16
    assert torch.equal(got, cpu_bf16.tile_linear(x, packed, bias))  # the tile kernel at one row too
    assert (got.double() - ref).abs().max().item() <= ref.abs().amax().item() * 2.0 ** -8


@needs_tiles
def test_tile_pack_is_the_vnni_layout_and_refuses_other_shapes():
    """tile (n, k)[r, 2c + j] = weight[16n + c, 32k + 2r + j] (Intel SDM's VNNI layout of a TDPBF16PS B operand)."""
    w = torch.arange(48 * 64, dtype=torch.float32).reshape(48, 64).bfloat16()
    p = cpu_bf16.tile_pack(w)
    assert p.shape == (3, 2, 16, 32) and p.dtype == torch.bfloat16
    want = w.view(3, 16, 2, 16, 2).permute(0, 2, 3, 1, 4).reshape(3, 2, 16, 32)  # [n, c, k, r, j] -> [n, k, r, c j]
    assert torch.equal(p, want)
    for bad in (torch.zeros(40, 64).bfloat16(), torch.zeros(48, 48).bfloat16(), torch.zeros(48, 64),
                torch.zeros(48).bfloat16()):
        with pytest.raises(ValueError, match="N % 16 == 0 and K % 32 == 0, got"):
            cpu_bf16.tile_pack(bad)


def _check_tile_kernel(kernel, m, n, k, max_rows):
    """``kernel`` (amx_linear / vnni_linear) on m rows: within one bf16 rounding (2^-8 relative to the largest
    output) of the float64 product and of ``F.linear``, with and without a bias; through packed_linear from 1 to
    ``max_rows`` rows (F.linear on the dense weight past it); a row's bits independent of the rows beside it."""
    gen = torch.Generator().manual_seed(m * 31 + n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    p = cpu_bf16.tile_pack(w)
    for b in (bias, None):
        got = kernel(x, p, b)
        ref = x.double() @ w.double().t() + (0 if b is None else b.double())
        assert got is not None and got.shape == (m, n) and got.dtype == torch.bfloat16
        tol = ref.abs().amax().item() * 2.0 ** -8
        assert (got.double() - ref).abs().max().item() <= tol
        assert (got.double() - F.linear(x, w, b).double()).abs().max().item() <= tol
    full = cpu_bf16.packed_linear(x, p, bias, dense=w)
    assert torch.equal(full, kernel(x, p, bias))
    big = torch.randn(max_rows + 1, k, generator=gen).bfloat16()
    assert torch.equal(cpu_bf16.packed_linear(big, p, bias, dense=w), F.linear(big, w, bias))
    # a row's result does not depend on the rows beside it (what keeps speculative verify passes, whose rows
    # are a request's tokens side by side, bit-identical to one-row decode steps)
    for r in (0, m // 2, m - 1):
        assert torch.equal(cpu_bf16.packed_linear(x[r:r + 1], p, bias, dense=w), full[r:r + 1])
        assert torch.equal(kernel(x[r:r + 1], p, bias), full[r:r + 1])


@needs_amx
@pytest.mark.parametrize("m", [2, 7, 16, 17, 32, 33, 50, 64, 100])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (48, 64)])  # 48: a last block of 16 columns
def test_amx_linear_matches_float64_and_f_linear(m, n, k):
    """AMX tiles: every row chunk of 32 and the tails of 1-16 and 17-31 rows (bit-identical to ``F.linear`` on the
    Xeon of 2026-12-04 up to M = 33)."""
    _check_tile_kernel(cpu_bf16.amx_linear, m, n, k, cpu_bf16.TILE_MAX_ROWS)


@needs_vnni
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 16, 33, 64, 100, 256])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (48, 64), (16, 32)])  # 48, 16: a last panel of 16
def test_vnni_linear_matches_float64_and_f_linear(m, n, k):
    """AVX-512 BF16: every block of 8 rows and its tails, panels of 32 columns and a last one of 16."""
    _check_tile_kernel(cpu_bf16.vnni_linear, m, n, k, cpu_bf16.TILE_MAX_ROWS)


@needs_vnni
def test_vnni_linear_keeps_nan_and_inf_and_rounds_to_nearest_even():
    """The vectorized rounding is the scalar one's (torch's .to(bfloat16)): NaN stays NaN, inf stays inf, and a sum
    half-way between two bf16 values rounds to the even one."""
    w = torch.zeros(16, 32).bfloat16()
    w[0, 0], w[1, 0], w[2, 0], w[3, 0] = float("nan"), float("inf"), 1.0, 1.0
    w[3, 2] = 2.0 ** -8  # 1 + 2^-8 is half-way between bf16 1 and 1 + 2^-7: rounds to 1 (even)
    w[4, 0], w[4, 2] = 1.0, 3 * 2.0 ** -8  # 1 + 3 * 2^-8: half-way, rounds up to 1 + 2^-6 (even)
    x = torch.zeros(1, 32).bfloat16()
    x[0, 0], x[0, 2] = 1.0, 1.0
    y = cpu_bf16.vnni_linear(x, cpu_bf16.tile_pack(w))[0].float()
    assert y[0].isnan() and y[1] == float("inf") and y[2] == 1.0 and y[3] == 1.0 and y[4] == 1.0 + 2.0 ** -6
    assert torch.equal(y[5:], torch.zeros(11))


@needs_tiles
def test_packed_linear_without_the_library_after_packing(monkeypatch):
    """Weights tile-packed, then the C++ library turned off (ROOFLINE_CPU_GEMV=0 / ROOFLINE_CPU_ATTENTION=0 read
    at the call): ``F.linear`` on the dense weight, or a clear error without it."""
    w = torch.randn(64, 96).bfloat16()
    x = torch.randn(5, 96).bfloat16()
    p = cpu_bf16.tile_pack(w)
    monkeypatch.setattr(cpu_bf16, "GEMV", False)
    assert torch.equal(cpu_bf16.packed_linear(x, p, dense=w), F.linear(x, w))
    with pytest.raises(ValueError, match="with the C\\+\\+ library on\\); pass the dense weight"):
        cpu_bf16.packed_linear(x, p)


@needs_tiles
@pytest.mark.parametrize("kernel", ["amx_linear", "vnni_linear"])
def test_tile_kernels_decline_what_they_do_not_cover(kernel):
    if kernel == "amx_linear" and not cpu_bf16.amx_available():
        pytest.skip("no AMX-BF16 here")
    if kernel == "vnni_linear" and not cpu_bf16.vnni_available():
        pytest.skip("no AVX-512 BF16 here")
    fn = getattr(cpu_bf16, kernel)
    p = cpu_bf16.tile_pack(torch.randn(32, 64).bfloat16())
    assert fn(torch.randn(4, 64), p) is None  # fp32 rows
    assert fn(torch.randn(4, 96).bfloat16(), p) is None  # K does not match
    assert fn(torch.randn(4, 64).bfloat16(), p, torch.randn(32)) is None  # fp32 bias
    assert fn(torch.randn(0, 64).bfloat16(), p).shape == (0, 32)
    assert fn(torch.randn(4, 64).bfloat16(), p, torch.randn(16).bfloat16()) is None  # a bias for another N
    assert fn(torch.randn(4, 64).bfloat16(), torch.cat([p, p], 1)[:, ::2]) is None  # tiles not contiguous
    assert fn(torch.randn(4, 64).bfloat16(), p.reshape(2, 2, 8, 64)) is None  # not [N/16, K/32, 16, 32]
    if kernel == "vnni_linear":
        assert fn(torch.randn(cpu_bf16.TILE_MAX_ROWS + 1, 64).bfloat16(), p) is None  # past its rows
    with pytest.raises(ValueError, match=r"tile kernel declined x torch.float32 \(4, 64\) against the tile-packed"):
        cpu_bf16.packed_linear(torch.randn(4, 64), p)  # no dense weight to fall back on: the error says why


@pytest.mark.parametrize("t,h", [(1, 576), (3, 576), (40, 960), (2, 17)])
def test_add_rmsnorm_matches_the_reference(t, h):
    """The fused C++ add + RMSNorm on bf16 rows: the residual sum bit-identical to the reference's (one bf16
    rounding of x + residual), the normed output within one bf16 step of it (only the fp32 sum of squares runs
    in another order), with and without the residual; and both within 2^-7 relative of float64."""
    from roofline.kernels import cpu_paged_attention as cpa
    from roofline.kernels.rmsnorm import ref_fused_add_rmsnorm, ref_rmsnorm

    if cpa.unavailable_reason() is not None:
        pytest.skip(cpa.unavailable_reason())
    gen = torch.Generator().manual_seed(t * 1000 + h)
    x = torch.randn(t, h, generator=gen).bfloat16()
    res = (3 * torch.randn(t, h, generator=gen)).bfloat16()
    w = (1 + 0.1 * torch.randn(h, generator=gen)).bfloat16()
    out, new_res = cpu_bf16.add_rmsnorm(x, res, w, 1e-5)
    want, want_res = ref_fused_add_rmsnorm(x, res, w, 1e-5)
    assert torch.equal(new_res, want_res)
    step = want.float().abs() * 2.0 ** -7  # one bf16 step at each value (8 significant bits)
    assert ((out.float() - want.float()).abs() <= step + 1e-30).all()
    plain = cpu_bf16.add_rmsnorm(x, None, w, 1e-5)
    want_plain = ref_rmsnorm(x, w, 1e-5).float()
    assert ((plain.float() - want_plain).abs() <= want_plain.abs() * 2.0 ** -7 + 1e-30).all()
    r64 = want_res.double()
    oracle = w.double() * r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert ((out.double() - oracle).abs() <= oracle.abs() * 2.0 ** -7 + 1e-12).all()


def test_add_rmsnorm_declines_what_it_does_not_cover():
    w = torch.ones(64).bfloat16()
    assert cpu_bf16.add_rmsnorm(torch.randn(2, 64), None, w, 1e-6) is None  # fp32 rows, a bf16 weight
    assert cpu_bf16.add_rmsnorm(torch.randn(2, 3, 64).bfloat16(), None, w, 1e-6) is None  # 3-D
    assert cpu_bf16.add_rmsnorm(torch.randn(64, 2).bfloat16().t(), None, w, 1e-6) is None  # not contiguous


@pytest.mark.parametrize("t,inter", [(1, 1536), (33, 1536), (3, 5)])
def test_silu_and_mul_matches_the_reference(t, inter):
    """The C++ SiLU-and-mul on bf16 rows against ``ref_silu_and_mul`` (torch's bf16 silu, then its bf16
    multiply): the same two roundings; only the fp32 exp is the C library's instead of SLEEF's (both within
    1 ulp of fp32), so at most one bf16 step apart, and on these 50k+ values at least 99.9% bit-identical (all of
    them on the Xeon of 2026-12-04)."""
    from roofline.kernels import cpu_paged_attention as cpa
    from roofline.kernels.activation import ref_silu_and_mul

    if cpa.unavailable_reason() is not None:
        pytest.skip(cpa.unavailable_reason())
    gen = torch.Generator().manual_seed(t + inter)
    x = (4 * torch.randn(t, 2 * inter, generator=gen)).bfloat16()
    got, want = cpu_bf16.silu_and_mul(x), ref_silu_and_mul(x)
    assert got.shape == want.shape == (t, inter) and got.dtype == torch.bfloat16
    step = want.float().abs() * 2.0 ** -7
    assert ((got.float() - want.float()).abs() <= step + 1e-30).all()
    assert (got == want).float().mean().item() >= 0.999
    xf = x.float()  # fp32 (the fp32 CPU decode plan's): within 4 fp32 ulps of the reference (Cephes' exp, ~1 ulp)
    got32, want32 = cpu_bf16.silu_and_mul(xf), ref_silu_and_mul(xf)
    assert got32.dtype == torch.float32
    assert ((got32 - want32).abs() <= want32.abs() * 2.0 ** -21 + 1e-30).all()
    assert cpu_bf16.silu_and_mul(xf.half()) is None  # fp16: the reference
    assert cpu_bf16.silu_and_mul(x[:, :-1]) is None  # not contiguous
