"""Dynamic per-token activation quantizers (INT8 for SmoothQuant W8A8, E4M3 for FP8 W8A8), each beside its
bit-exact pure-torch ``ref_`` twin: one program per row, amax, IEEE division, round to the code."""

from __future__ import annotations

import torch

from roofline.kernels.quant_types import FP8_E4M3_MAX, INT8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

from roofline.kernels.quant_layouts import _MIN_SCALE, _as_rows


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

    @triton.jit
    def _per_token_quant_kernel(X, Q, S, K, stride_x, stride_q, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(X + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        amax_row = tl.max(amax, axis=0)
        scale = tl.maximum(tl.div_rn(amax_row, 127.0), 1e-10)  # IEEE division, as the ref
        scale_v = tl.zeros([BLOCK], tl.float32) + scale  # div_rn takes equal shapes
        for k0 in range(0, K, BLOCK):
            kmask = k0 + offs < K
            x = tl.load(X + row * stride_x + k0 + offs, mask=kmask, other=0.0).to(tl.float32)
            y = tl.div_rn(x, scale_v)
            # Round half to even (torch.round): adding 1.5 * 2^23 leaves no fraction bits, and IEEE
            # round-to-nearest-even does the rounding; exact for |y| < 2^22 (here |y| <= 127).
            y = (y + 12582912.0) - 12582912.0
            y = tl.minimum(tl.maximum(y, -127.0), 127.0)
            tl.store(Q + row * stride_q + k0 + offs, y.to(tl.int8), mask=kmask)
        tl.store(S + row, scale)

    @triton.jit
    def _per_token_quant_fp8_kernel(X, Q, S, K, stride_x, stride_q, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(X + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        amax_row = tl.max(amax, axis=0)
        scale = tl.maximum(tl.div_rn(amax_row, 448.0), 1e-10)  # IEEE division, as the ref
        scale_v = tl.zeros([BLOCK], tl.float32) + scale
        for k0 in range(0, K, BLOCK):
            kmask = k0 + offs < K
            x = tl.load(X + row * stride_x + k0 + offs, mask=kmask, other=0.0).to(tl.float32)
            y = tl.minimum(tl.maximum(tl.div_rn(x, scale_v), -448.0), 448.0)  # saturate: E4M3FN has no inf
            tl.store(Q + row * stride_q + k0 + offs, y.to(Q.dtype.element_ty), mask=kmask)
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
        _per_token_quant_kernel[(m,)](x2, q, scale, k, x2.stride(0), q.stride(0), BLOCK=block,
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
        _per_token_quant_fp8_kernel[(m,)](x2, q, scale, k, x2.stride(0), q.stride(0), BLOCK=block,
                                          num_warps=4 if block <= 1024 else 8)
    return q, scale
