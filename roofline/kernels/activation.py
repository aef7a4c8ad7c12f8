"""SiLU-and-mul (the SwiGLU gate of Llama MLPs; Shazeer 2020) as one Triton pass, beside its torch twin.

x [T, 2I] holds the fused gate_up projection: gate = x[:, :I], up = x[:, I:]. The output
silu(gate) * up is rounded exactly as HF's ``act_fn(gate_proj(x)) * up_proj(x)`` on separate tensors:
silu computed in fp32 and rounded to the input dtype, then the product rounded again.
Memory-bound: reads 2I and writes I elements per row, once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roofline.kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def ref_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> [..., I] = silu(x[..., :I]) * x[..., I:] (HF rounding)."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def silu_and_mul_cols(X, row, cols, mask, stride_x, inter):
        """silu(gate) * up at columns ``cols`` of row ``row`` (int64) of X [T, 2 inter], in X's dtype (HF's two
        roundings). Shared by this module's kernel and ``roofline.kernels.act_quant``'s SiLU-and-mul + quantize."""
        g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        u = tl.load(X + row * stride_x + inter + cols, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # silu rounded to the input dtype, as torch's F.silu
        return (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)

    @triton.jit
    def _silu_and_mul_kernel(X, Out, stride_x, stride_o, inter, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
        if PDL:  # roofline.kernels.pdl
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        tl.store(Out + row * stride_o + cols, silu_and_mul_cols(X, row, cols, mask, stride_x, inter), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation.

    Args:
        x: [..., 2I] fp32/fp16/bf16, last dim contiguous.

    Returns:
        [..., I] in x's dtype.

    Raises:
        ValueError: odd last dim. RuntimeError: triton missing.
    """
    if triton is None:
        raise RuntimeError("triton is not installed; use ref_silu_and_mul on this machine")
    if x.shape[-1] % 2:
        raise ValueError(f"last dim must be even (gate and up halves), got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    if x2.shape[0] > 0:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4, **pdl.launch_kwargs(x.device)
        )
    return out.view(*x.shape[:-1], inter)
