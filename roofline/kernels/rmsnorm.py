"""RMSNorm and fused residual-add + RMSNorm (Triton), beside their pure-torch twins.

RMSNorm (Zhang & Sennrich 2019) with Hugging Face ``LlamaRMSNorm`` rounding: the statistics and the
normalisation run in fp32, the result is cast back to the input dtype, and only then multiplied by the
weight (``weight * hidden.to(input_dtype)``). The fused variant first adds the residual in the input
dtype, exactly as a decoder layer does (``residual + hidden``), so the kernel and the HF layer round at
the same places and greedy decoding can stay token-identical.

One program normalises one row; the whole row sits in registers (hidden sizes up to 16k), so each
element is read once and written once: the op is memory-bound at 2 (or 4, fused) bytes-per-element passes.
"""

from __future__ import annotations

import torch

from roofline.kernels import pdl

try:  # triton is optional: the core (CPU path) never imports this module's kernels.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None


def ref_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: x [..., hidden] any float dtype, weight [hidden]; returns promote(weight, x) dtype."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def ref_fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (ref_rmsnorm(x + residual), x + residual); the add rounds in the input dtype, as in HF."""
    new_residual = x + residual
    return ref_rmsnorm(new_residual, weight, eps), new_residual


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def hf_rmsnorm_apply(x, rstd, w, OUT_T: tl.constexpr):
        """The HF rounding of an RMSNorm's output, shared by every Triton RMSNorm (this module's,
        ``roofline.kernels.qk_norm``'s, ``roofline.kernels.rope_cache``'s q/k norm): ``x * rstd`` in fp32 cast
        to x's dtype, then ``w * that`` in fp32 cast to ``OUT_T``. x: a tile of rows; rstd: fp32
        ``rsqrt(mean(x^2) + eps)`` per row, broadcastable to x; w: the weight, broadcastable to x."""
        y = (x.to(tl.float32) * rstd).to(x.dtype)  # cast back before the weight, as HF does
        return (w.to(tl.float32) * y.to(tl.float32)).to(OUT_T)

    @triton.jit
    def add_rmsnorm_row(X, R, W, ResOut, row, stride_x, stride_r, stride_ro, N, eps, OUT_T: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        """One row (``row``, int64) of (residual add +) RMSNorm, the whole row in registers: stores x + residual
        to ResOut (HAS_RESIDUAL), returns the normed row [BLOCK] in OUT_T (0 past N) and the column mask.
        Shared by this module's kernel and ``roofline.kernels.act_quant``'s norm + quantize."""
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
            # Round the sum to the input dtype first: HF adds bf16 + bf16 -> bf16.
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(ResOut + row * stride_ro + cols, x, mask=mask)
        h = x.to(tl.float32)
        var = tl.sum(h * h, axis=0) / N
        w = tl.load(W + cols, mask=mask, other=0.0)
        return hf_rmsnorm_apply(x, tl.rsqrt(var + eps), w, OUT_T), mask

    @triton.jit
    def _rmsnorm_kernel(
        X, R, W, Out, ResOut,
        stride_x, stride_r, stride_o, stride_ro,
        N, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0,
    ):
        if PDL:  # roofline.kernels.pdl: every load and store below depends on the previous kernel
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        out, mask = add_rmsnorm_row(X, R, W, ResOut, row, stride_x, stride_r, stride_ro, N, eps,
                                    Out.dtype.element_ty, HAS_RESIDUAL, BLOCK)
        tl.store(Out + row * stride_o + tl.arange(0, BLOCK), out, mask=mask)


def row_num_warps(block: int) -> int:
    """Warps of a kernel holding a row of ``block`` (a power of two) elements in registers, one program per row
    (this module's, and ``roofline.kernels.act_quant``'s fused norm / SiLU-and-mul + quantize)."""
    return 4 if block <= 2048 else (8 if block <= 8192 else 16)


def _launch(x, residual, weight, eps):
    if triton is None:
        raise RuntimeError("triton is not installed; use ref_rmsnorm on this machine")
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {hidden}")
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty_like(x2)
    else:
        r2, res_out = x2, out  # unused placeholders (HAS_RESIDUAL=False)
    block = triton.next_power_of_2(hidden)
    num_warps = row_num_warps(block)
    if x2.shape[0] > 0:
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps, **pdl.launch_kwargs(x.device),
        )
    return out.view(x.shape), (res_out.view(x.shape) if residual is not None else None)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim.

    Args:
        x: [..., hidden] fp32/fp16/bf16.
        weight: [hidden].
        eps: added to the mean square (e.g. 1e-5 or 1e-6).

    Returns:
        [..., hidden] in promote_types(weight.dtype, x.dtype), HF LlamaRMSNorm rounding.

    Raises:
        ValueError: weight shape mismatch. RuntimeError: triton missing.
    """
    return _launch(x, None, weight, eps)[0]


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm in one pass: reads x and residual once, writes both outputs once.

    Args:
        x, residual: [..., hidden], same dtype and shape.
        weight: [hidden]; eps as in :func:`rmsnorm`.

    Returns:
        (normed, new_residual) with new_residual = x + residual (rounded in x's dtype) and
        normed = rmsnorm(new_residual, weight, eps).
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)}/{residual.dtype} must match x {tuple(x.shape)}/{x.dtype}")
    normed, new_residual = _launch(x, residual, weight, eps)
    return normed, new_residual
