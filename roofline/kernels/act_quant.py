"""Dynamic per-token activation quantizers (INT8 for SmoothQuant W8A8, E4M3 for FP8 W8A8), each beside its
bit-exact pure-torch ``ref_`` twin: one program per row, amax, IEEE division, round to the code.

The same quantization fused into the kernel that produces a W8A8 linear's input (issue 28, "fewer kernels per
layer"): residual add + RMSNorm + quantize (the input of qkv and gate_up) and SiLU-and-mul + quantize (the input of
down). Each writes the codes and scales instead of the 16-bit activation, so the separate quantizer's launch and
its two reads and one write of the activation go away. The arithmetic is the two kernels' (the same jit helpers),
but not always the order of the norm's fp32 sum of squares: the compiler lays the row out for the kernel's store
(16 elements a thread for 1-byte codes past 1,024 channels, 8 for a 16-bit row), so a row's rstd can differ in its
last bit, flipping the 16-bit rounding of a few normed elements and moving their codes by one step (a CPU
emulation of the two orders at 4,096 x 4,096 bf16: 8 codes in one row). Up to 1,024 16-bit channels the layouts
match and the codes are bit-identical (tested on the GPU); SiLU-and-mul has no sum and is always exact.
``QuantizedActivation`` carries them to the linear layer (``roofline.kernels.linear_dispatch``)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from roofline.kernels import pdl
from roofline.kernels.activation import ref_silu_and_mul
from roofline.kernels.quant_types import FP8_E4M3_MAX, INT8_MAX
from roofline.kernels.rmsnorm import ref_fused_add_rmsnorm, ref_rmsnorm, row_num_warps

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

from roofline.kernels.quant_layouts import _MIN_SCALE, _as_rows

QUANT_FORMATS = ("int8", "fp8")  # the per-token activation formats: SmoothQuant's INT8, FP8 W8A8's E4M3


class QuantizedActivation(NamedTuple):
    """A linear layer's input already quantized per token by its producer (a fused norm or SiLU-and-mul), as
    the W8A8 linear would quantize it itself (:func:`per_token_quant_int8` / :func:`per_token_quant_fp8`).

    codes: int8 or float8_e4m3fn [T, K]; scales: float32 [T, 1]; dtype: the 16-bit activation dtype the layer
    computes in (its output's dtype)."""

    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def fmt(self) -> str:
        return "fp8" if self.codes.dtype == torch.float8_e4m3fn else "int8"


def _check_fmt(fmt: str) -> None:
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"activation quantization format must be one of {QUANT_FORMATS}, got {fmt!r}")


def ref_per_token_quant(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ref_per_token_quant_int8` (``fmt`` "int8") or :func:`ref_per_token_quant_fp8` ("fp8") of x
    [..., K] as rows. Raises ValueError for another ``fmt``."""
    _check_fmt(fmt)
    rows = x.reshape(-1, x.shape[-1])
    return ref_per_token_quant_int8(rows) if fmt == "int8" else ref_per_token_quant_fp8(rows)


def ref_rmsnorm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Twin of :func:`rmsnorm_quant`: HF RMSNorm of x (+ residual, added in x's dtype), then the per-token
    quantizer's ``ref_``. Returns (codes [M, K], scales float32 [M, 1], x + residual or None)."""
    if residual is None:
        return (*ref_per_token_quant(ref_rmsnorm(x, weight, eps), fmt), None)
    normed, new_residual = ref_fused_add_rmsnorm(x, residual, weight, eps)
    return (*ref_per_token_quant(normed, fmt), new_residual)


def ref_silu_and_mul_quant(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of :func:`silu_and_mul_quant`: HF's ``silu(gate) * up`` of x [..., 2I], then the per-token quantizer's
    ``ref_``. Returns (codes [M, I], scales float32 [M, 1])."""
    return ref_per_token_quant(ref_silu_and_mul(x), fmt)


def ref_per_token_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of :func:`per_token_quant_int8` (bit-exact): ``scale = max(amax / 127, 1e-10)`` (IEEE division),
    ``q = clamp(round_half_even(x / scale), -127, 127)``. Returns (int8 ``[M, K]``, float32 ``[M, 1]``)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # A tensor divisor: CUDA torch computes ``t / scalar`` as ``t * (1 / scalar)`` (see kernels/common.py).
    scale = (amax / torch.full_like(amax, INT8_MAX)).clamp(min=_MIN_SCALE)
    return torch.round(xf / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def ref_per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of :func:`per_token_quant_fp8` (bit-exact on the GPU): ``scale = max(amax / 448, 1e-10)`` (IEEE
    division by a tensor), ``q = clamp(x / scale, -448, 448)`` rounded to nearest-even E4M3.
    Returns (float8_e4m3fn ``[M, K]``, float32 ``[M, 1]``)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = (amax / torch.full_like(amax, FP8_E4M3_MAX)).clamp(min=_MIN_SCALE)
    return (xf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale



if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from roofline.kernels.activation import silu_and_mul_cols
    from roofline.kernels.rmsnorm import add_rmsnorm_row

    @triton.jit
    def _row_scale(amax, FP8: tl.constexpr):
        # the per-token scale of a row from its amax: max(amax / QMAX, 1e-10), IEEE division as the refs
        if FP8:
            return tl.maximum(tl.div_rn(amax, 448.0), 1e-10)
        return tl.maximum(tl.div_rn(amax, 127.0), 1e-10)

    @triton.jit
    def _to_codes(x, scale, FP8: tl.constexpr):
        # x fp32 [BLOCK] -> the code values (fp32; the store casts them to int8 / float8_e4m3fn exactly)
        y = tl.div_rn(x, tl.zeros(x.shape, tl.float32) + scale)  # div_rn takes equal shapes
        if FP8:
            return tl.minimum(tl.maximum(y, -448.0), 448.0)  # saturate: E4M3FN has no inf
        # Round half to even (torch.round): adding 1.5 * 2^23 leaves no fraction bits, and IEEE
        # round-to-nearest-even does the rounding; exact for |y| < 2^22 (here |y| <= 127).
        y = (y + 12582912.0) - 12582912.0
        return tl.minimum(tl.maximum(y, -127.0), 127.0)

    @triton.jit
    def _store_codes(out, QRow, SRow, mask, FP8: tl.constexpr):
        # a whole row's codes (fp32 values [BLOCK], 0 where masked) and its scale
        scale = _row_scale(tl.max(tl.abs(out), axis=0), FP8)
        tl.store(QRow + tl.arange(0, out.shape[0]), _to_codes(out, scale, FP8).to(QRow.dtype.element_ty), mask=mask)
        tl.store(SRow, scale)

    @triton.jit
    def _rmsnorm_quant_kernel(X, R, W, Q, S, ResOut, stride_x, stride_r, stride_q, stride_ro, N, eps,
                              HAS_RESIDUAL: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr,
                              PDL: tl.constexpr = 0):
        # roofline.kernels.rmsnorm._rmsnorm_kernel's row, then _per_token_quant_kernel's on its 16-bit output
        if PDL:  # roofline.kernels.pdl: every load and store below depends on the previous kernel
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        out, mask = add_rmsnorm_row(X, R, W, ResOut, row, stride_x, stride_r, stride_ro, N, eps, X.dtype.element_ty,
                                    HAS_RESIDUAL, BLOCK)
        _store_codes(out.to(tl.float32), Q + row * stride_q, S + row, mask, FP8)  # masked columns are 0

    @triton.jit
    def _silu_and_mul_quant_kernel(X, Q, S, stride_x, stride_q, inter, FP8: tl.constexpr, BLOCK: tl.constexpr,
                                   PDL: tl.constexpr = 0):
        # roofline.kernels.activation._silu_and_mul_kernel's row (whole), then the per-token quantizer's
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < inter
        out = silu_and_mul_cols(X, row, cols, mask, stride_x, inter)
        _store_codes(out.to(tl.float32), Q + row * stride_q, S + row, mask, FP8)  # masked columns are 0

    @triton.jit
    def _e4m3_value(code):
        # E4M3FN code bits (uint8) -> fp32, by integer arithmetic (OCP FP8 2023: bias 7; a saturating conversion
        # never makes the NaN code, so it is not special-cased): normal (8 + m) * 2^(e - 10), subnormal m * 2^-9.
        c = code.to(tl.int32)
        e = (c >> 3) & 15
        m = (c & 7).to(tl.float32)
        mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
        return tl.where((c & 128) != 0, -mag, mag)

    @triton.jit
    def _split_quant_kernel(X, Hi, Lo, S, M, stride_x, K: tl.constexpr, ROWS: tl.constexpr):
        # ROWS whole rows of K (a power of two) per program: amax, scale, hi = e4m3(x / scale), lo = e4m3(the rest);
        # hi read back from its bits (_e4m3_value), not by an fp8 -> fp32 cast (module note at SPLIT_LO).
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, K)
        rmask = rows < M
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        scale = _row_scale(tl.max(tl.abs(x), axis=1), True)
        y = tl.div_rn(x, tl.zeros(x.shape, tl.float32) + scale[:, None])
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        hi = y.to(tl.float8e4nv)
        lo = (y - _e4m3_value(hi.to(tl.uint8, bitcast=True))).to(tl.float8e4nv)
        offs = rows[:, None] * K + cols[None, :]
        tl.store(Hi + offs, hi, mask=rmask[:, None])
        tl.store(Lo + offs, lo, mask=rmask[:, None])
        tl.store(S + rows, scale, mask=rmask)

    @triton.jit
    def _per_token_quant_kernel(X, Q, S, K, stride_x, stride_q, FP8: tl.constexpr, BLOCK: tl.constexpr):
        # two passes over a row in BLOCK chunks (any K): amax, then the codes
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(X + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = _row_scale(tl.max(amax, axis=0), FP8)
        for k0 in range(0, K, BLOCK):
            kmask = k0 + offs < K
            x = tl.load(X + row * stride_x + k0 + offs, mask=kmask, other=0.0).to(tl.float32)
            tl.store(Q + row * stride_q + k0 + offs, _to_codes(x, scale, FP8).to(Q.dtype.element_ty), mask=kmask)
        tl.store(S + row, scale)




def per_token_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric INT8 per row: ``scale = max(amax / 127, 1e-10)``, ``q = clamp(round(x / scale), +-127)``.

    Bit-exact with :func:`ref_per_token_quant_int8` (IEEE division, round half to even). Against
    ``roofline.quant.quantize.quantize_per_token_int8`` the codes agree within 1 LSB: that function
    divides amax by the Python scalar 127, which CUDA torch computes as ``amax * (1/127)``, so its scale
    can differ by one ulp and flip a code that sits at a rounding tie.

    Args:
        x: [..., K] float16/bfloat16/float32.

    Returns:
        (q int8 [M, K], scale float32 [M, 1]) with M = prod of x's leading dims.

    Raises:
        RuntimeError: triton missing.
    """
    if triton is None:
        raise RuntimeError("triton is not installed; use ref_per_token_quant_int8 on this machine")
    k = x.shape[-1]
    x2 = _as_rows(x, k, "per_token_quant_int8")
    m = x2.shape[0]
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(4096, triton.next_power_of_2(max(k, 16)))
        _per_token_quant_kernel[(m,)](x2, q, scale, k, x2.stride(0), q.stride(0), FP8=False, BLOCK=block,
                                      num_warps=4 if block <= 1024 else 8)
    return q, scale


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic E4M3 per row, one launch: ``scale = max(amax / 448, 1e-10)``, ``q = e4m3(clamp(x / scale, +-448))``
    (round to nearest even, saturating; 448 is the largest finite float8_e4m3fn, OCP 8-bit FP spec 2023).

    Bit-exact on the GPU with :func:`ref_per_token_quant_fp8` (IEEE division). Against
    ``roofline.quant.quantize.quantize_per_token_fp8`` the scales may differ by 1 ulp (that function divides
    amax by the Python scalar 448, which CUDA torch computes as ``amax * (1/448)``, as for the INT8
    quantizer), so a code at a rounding tie may move by one E4M3 step. Under the Triton CPU interpreter the
    scales are exact but the fp32 -> fp8 conversion is not (it drops the carry across a power of two).

    Args:
        x: [..., K] float16/bfloat16/float32.

    Returns:
        (q float8_e4m3fn [M, K], scale float32 [M, 1]) with M = prod of x's leading dims, the
        ``scale_a`` layout of ``torch._scaled_mm``'s row-wise scaling.

    Raises:
        RuntimeError: triton missing.
    """
    if triton is None:
        raise RuntimeError("triton is not installed; use ref_per_token_quant_fp8 on this machine")
    k = x.shape[-1]
    x2 = _as_rows(x, k, "per_token_quant_fp8")
    m = x2.shape[0]
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(4096, triton.next_power_of_2(max(k, 16)))
        _per_token_quant_kernel[(m,)](x2, q, scale, k, x2.stride(0), q.stride(0), FP8=True, BLOCK=block,
                                      num_warps=4 if block <= 1024 else 8)
    return q, scale


# How ``per_token_quant_fp8_split`` computes lo on a GPU: "bits", one fused Triton kernel that reads hi back from
# its bits (0.30 ms at 32k tokens x 32 heads x 128 on an H100), or "torch" (per_token_quant_fp8, then five fp32
# torch passes: 2.7-3.2 ms). Both are bit-exact with the twin (bench/fp8_split_quant_probe.py,
# bench/results/fp8-prefill-h100-20261207b/quantizer/, where an inline-PTX cvt variant measured 0.26-0.32 ms).
# Reading hi back by Triton's own fp8 -> fp32 cast in registers gave wrong values on the H100 (Triton 3.6: lo -160
# where -4.5 was due, some NaN), hence the bits.
SPLIT_LO = "bits"


def _fp8_remainder(x2: torch.Tensor, hi: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """lo = e4m3(clamp(x / scale, +-448) - hi) (round to nearest even) of rows x2 [M, K] with their E4M3 codes and
    scales (the clamp, as the kernel's: a row's amax element may divide to 448 + 1 ulp, whose remainder would be
    -0 instead of +0)."""
    return ((x2.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX) - hi.float()).to(torch.float8_e4m3fn)


def ref_per_token_quant_fp8_split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin of :func:`per_token_quant_fp8_split`: ``hi, scale = ref_per_token_quant_fp8(x)`` and
    ``lo = e4m3(clamp(x / scale, +-448) - hi)`` (round to nearest even), so ``(hi + lo) * scale`` carries about 7 significant
    bits of each element instead of E4M3's 4. Returns (hi, lo float8_e4m3fn ``[M, K]``, scale float32 ``[M, 1]``)."""
    x2 = x.reshape(-1, x.shape[-1])
    hi, scale = ref_per_token_quant_fp8(x2)
    return hi, _fp8_remainder(x2, hi, scale), scale


def per_token_quant_fp8_split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two-term dynamic E4M3 per row: the codes and scale of :func:`per_token_quant_fp8` (``hi``) and the E4M3
    rounding of the remainder ``clamp(x / scale) - hi`` (``lo``, same scale), in one fused Triton kernel on a GPU
    (``SPLIT_LO``; rows of a power of two <= 1,024 channels) and in torch otherwise. Two FP8
    products, ``hi . k`` and ``lo . k``, into one accumulator then give q . k with q at about bf16's precision. The
    FP8 prefill attention kernel (``roofline.kernels.gluon_prefill``) uses this for q: with q rounded to E4M3
    alone, the default model's KL against an unquantized cache rose from 7.2e-3 to 1.1e-2
    (``bench/results/fp8-prefill-quality-cpu-20261207/``).

    Bit-exact on the GPU with :func:`ref_per_token_quant_fp8_split` (every code of 1M rows x 128 on an H100,
    2026-12-07; the tests check more shapes).

    Args:
        x: [..., K] float16/bfloat16/float32.

    Returns:
        (hi, lo float8_e4m3fn [M, K], scale float32 [M, 1]), M = prod of x's leading dims.

    Raises:
        RuntimeError: triton missing.
    """
    k = x.shape[-1]
    if SPLIT_LO == "torch" or triton is None or not x.is_cuda or k & (k - 1) or k > 1024:
        hi, scale = per_token_quant_fp8(x)
        return hi, _fp8_remainder(x.reshape(-1, k), hi, scale), scale
    x2 = _as_rows(x, k, "per_token_quant_fp8_split")
    m = x2.shape[0]
    hi = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    lo = torch.empty_like(hi)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        rows = max(1, 2048 // k)
        _split_quant_kernel[(triton.cdiv(m, rows),)](x2, hi, lo, scale, m, x2.stride(0), K=k, ROWS=rows,
                                                      num_warps=4)
    return hi, lo, scale


def _codes_like(rows: int, k: int, fmt: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.float8_e4m3fn if fmt == "fp8" else torch.int8
    return (torch.empty((rows, k), dtype=dtype, device=device),
            torch.empty((rows, 1), dtype=torch.float32, device=device))


def rmsnorm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                  fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(Residual add +) RMSNorm + per-token quantization in one pass: what ``fused_add_rmsnorm`` (or ``rmsnorm``)
    followed by ``per_token_quant_{fmt}`` computes (to one code step in a rare row: module docstring), without writing
    the 16-bit normed row. One
    program holds a row in registers (hidden sizes up to 16k), reads x (and residual) once and writes the codes,
    the scale (and x + residual).

    Args:
        x: [..., hidden] float16/bfloat16; residual: None or x's shape and dtype.
        weight: [hidden] in x's dtype; eps: as in ``rmsnorm``.
        fmt: "int8" (symmetric, amax / 127, round half to even) or "fp8" (E4M3, amax / 448, saturating).

    Returns:
        (codes int8/float8_e4m3fn [M, hidden], scales float32 [M, 1], x + residual [..., hidden] or None),
        M = prod of x's leading dims.

    Raises:
        ValueError: an unknown ``fmt``, a weight or residual that does not match x. RuntimeError: triton
        missing.
    """
    if triton is None:
        raise RuntimeError("triton is not installed; use ref_rmsnorm_quant on this machine")
    _check_fmt(fmt)
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or weight.dtype != x.dtype:
        raise ValueError(f"weight {tuple(weight.shape)}/{weight.dtype} must be ({hidden},)/{x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)}/{residual.dtype} must match x {tuple(x.shape)}/{x.dtype}")
    x2 = _as_rows(x, hidden, "rmsnorm_quant")
    r2 = _as_rows(residual, hidden, "rmsnorm_quant") if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else x2  # x2: an unused placeholder
    q, scale = _codes_like(x2.shape[0], hidden, fmt, x.device)
    block = triton.next_power_of_2(hidden)
    if x2.shape[0]:
        _rmsnorm_quant_kernel[(x2.shape[0],)](
            x2, r2, weight, q, scale, res_out, x2.stride(0), r2.stride(0), q.stride(0), res_out.stride(0), hidden,
            eps, HAS_RESIDUAL=residual is not None, FP8=fmt == "fp8", BLOCK=block,
            num_warps=row_num_warps(block), **pdl.launch_kwargs(x.device))
    return q, scale, (res_out.view(x.shape) if residual is not None else None)


def silu_and_mul_quant(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU-and-mul + per-token quantization in one pass: ``per_token_quant_{fmt}(silu_and_mul(x))`` (bit for bit),
    without writing the 16-bit activation (one program per row, the row in registers: I up to 32k).

    Args:
        x: [..., 2I] float16/bfloat16 (gate | up halves, last dim contiguous); fmt: "int8" or "fp8".

    Returns:
        (codes int8/float8_e4m3fn [M, I], scales float32 [M, 1]), M = prod of x's leading dims.

    Raises:
        ValueError: an odd last dim, an unknown ``fmt``. RuntimeError: triton missing.
    """
    if triton is None:
        raise RuntimeError("triton is not installed; use ref_silu_and_mul_quant on this machine")
    _check_fmt(fmt)
    if x.shape[-1] % 2:
        raise ValueError(f"last dim must be even (gate and up halves), got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    x2 = _as_rows(x, x.shape[-1], "silu_and_mul_quant")
    q, scale = _codes_like(x2.shape[0], inter, fmt, x.device)
    block = triton.next_power_of_2(inter)
    if x2.shape[0]:
        _silu_and_mul_quant_kernel[(x2.shape[0],)](
            x2, q, scale, x2.stride(0), q.stride(0), inter, FP8=fmt == "fp8", BLOCK=block,
            num_warps=row_num_warps(block), **pdl.launch_kwargs(x.device))
    return q, scale
