"""Dequantize kernels for the "dequantize, then dense cuBLAS GEMM" path at large M, each beside its
pure-torch ``ref_`` twin: INT4 (kernel layout) and INT8 weights to a dense ``[N, K]`` in the activation dtype."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

from roofline.kernels.quant_layouts import FMT_INT4, FMT_INT8, unpack_int4


def ref_dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                        dtype: torch.dtype | None = None) -> torch.Tensor:
    """Twin of :func:`dequantize_int4`: ``[N, K]`` = ``(q - z) * s`` in fp32, cast once to ``dtype``
    (default: the scales' dtype)."""
    q = unpack_int4(qweight).float()  # [N, K]
    g = torch.arange(q.shape[1], device=q.device) // group_size
    w = (q - zeros.float().t()[:, g]) * scales.float().t()[:, g]
    return w.to(dtype or scales.dtype)


def ref_dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Twin of :func:`dequantize_int8`: ``[N, K]`` = ``q * scales[:, None]`` in fp32, cast to ``dtype``."""
    return (q.float() * scales.float()[:, None]).to(dtype)



if triton is not None:

    @triton.jit
    def _dequant_kernel(
        W, S, Z, Out, N, K, stride_wr, stride_sg, stride_on,
        FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (ks[:, None] < K) & (offs_n[None, :] < N)  # [BLOCK_K, BLOCK_N]
        if FMT == 1:
            words = tl.load(W + (ks // 8)[:, None].to(tl.int64) * stride_wr + offs_n[None, :], mask=mask, other=0)
            qf = (((words >> ((ks % 8) * 4)[:, None]) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
            sg = (ks // GROUP)[:, None] * stride_sg + offs_n[None, :]
            s = tl.load(S + sg, mask=mask, other=0.0).to(tl.float32)
            z = tl.load(Z + sg, mask=mask, other=0.0).to(tl.float32) + 8388608.0
            w = (qf - z) * s
        else:
            q = tl.load(W + offs_n[None, :].to(tl.int64) * stride_wr + ks[:, None], mask=mask, other=0)
            w = q.to(tl.float32) * tl.load(S + offs_n, mask=offs_n < N, other=0.0)[None, :]
        tl.store(Out + offs_n[None, :].to(tl.int64) * stride_on + ks[:, None], w.to(Out.dtype.element_ty), mask=mask)




def _launch_dequant(fmt: int, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, n: int, k: int,
                    group: int, dtype: torch.dtype) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("triton is not installed; use the ref_ twins on this machine")
    out = torch.empty((n, k), dtype=dtype, device=w.device)
    if n and k:
        block_n, block_k = 64, 64
        _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
            w, s, z if z is not None else s, out, n, k, w.stride(0), z.stride(0) if z is not None else 0,
            out.stride(0), FMT=fmt, GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        )
    return out


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense ``[N, K]`` weight of an INT4 weight in the kernel layout, for a following dense GEMM.

    Args:
        qweight: int32 [K // 8, N]; scales, zeros: [K // G, N]; group_size: G.
        dtype: output dtype (default: the scales' dtype).

    Returns:
        [N, K] ``(q - z) * s`` computed in fp32 and rounded once (equal to ``Int4Weight.dequantize(dtype)``
        when the canonical scales are representable in the scales' dtype).

    Raises:
        ValueError: shapes that disagree. RuntimeError: triton missing.
    """
    k8, n = qweight.shape
    if qweight.dtype != torch.int32 or (k8 * 8) % group_size or scales.shape != (k8 * 8 // group_size, n) \
            or zeros.shape != scales.shape:
        raise ValueError(f"dequantize_int4: qweight {tuple(qweight.shape)} {qweight.dtype}, scales "
                         f"{tuple(scales.shape)}, zeros {tuple(zeros.shape)}, group size {group_size} disagree")
    return _launch_dequant(FMT_INT4, qweight.contiguous(), scales.contiguous(), zeros.contiguous(), n, k8 * 8,
                           group_size, dtype or scales.dtype)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense ``[N, K]`` weight ``q * scales[:, None]`` (fp32 product, rounded once to ``dtype``).

    Args:
        q: int8 [N, K]; scales: float32 [N].

    Raises:
        ValueError: shapes or dtypes that disagree. RuntimeError: triton missing.
    """
    n, k = q.shape
    if q.dtype != torch.int8 or scales.numel() != n:
        raise ValueError(f"dequantize_int8: want int8 q [N, K] and scales [N], got {q.dtype} {tuple(q.shape)} / "
                         f"{tuple(scales.shape)}")
    return _launch_dequant(FMT_INT8, q.contiguous(), scales.float().reshape(-1).contiguous(), None, n, k, 1, dtype)
