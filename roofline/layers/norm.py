"""RMSNorm (Zhang & Sennrich 2019), with the residual add fused in as in vLLM.

Numerics follow Hugging Face ``LlamaRMSNorm`` (see ``roofline.kernels.rmsnorm``): normalize in fp32, cast
back, then scale by the weight. With kernels enabled on CUDA the fused Triton kernel runs, else its
``ref_`` twin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from roofline.kernels.act_quant import QuantizedActivation
from roofline.kernels.rmsnorm import ref_fused_add_rmsnorm, ref_rmsnorm
from roofline.layers import dispatch

if TYPE_CHECKING:
    from roofline.layers.linear import LinearBase


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, quant_for: LinearBase | None = None
    ) -> torch.Tensor | QuantizedActivation | tuple[torch.Tensor | QuantizedActivation, torch.Tensor]:
        """x: [..., hidden] (2-D or more). With ``residual``, returns (rmsnorm(x + residual), x + residual).

        ``quant_for``: the linear layer this norm feeds. Where that layer would quantize its input per token in a
        pass of its own (W8A8 above decode sizes, ``LinearBase.input_quant``), the norm writes the codes in the same
        kernel (``roofline.kernels.act_quant.rmsnorm_quant``, the same codes to one step in a rare row) and returns a
        ``QuantizedActivation`` in place of the normed tensor; only that layer may consume it."""
        fmt = quant_for.input_quant(x) if quant_for is not None else None
        if fmt is not None and self.weight.dtype == x.dtype:
            from roofline.kernels.act_quant import rmsnorm_quant

            codes, scales, new_residual = rmsnorm_quant(x, residual, self.weight, self.eps, fmt)
            out = QuantizedActivation(codes, scales, x.dtype)
            return out if residual is None else (out, new_residual)
        kernels = dispatch.kernels_for(x)
        if kernels is None and x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu":
            from roofline.kernels.cpu_bf16 import add_rmsnorm

            if (fused := add_rmsnorm(x, residual, self.weight, self.eps)) is not None:
                return fused
        if residual is None:
            # 3-D too: Qwen3's per-head q_norm / k_norm on [T, heads, head_dim], normed as [T * heads, head_dim]
            # rows (a view at T = 1; one copy where the qkv split leaves rows unevenly strided).
            if kernels is not None and x.dim() >= 2:
                return kernels.rmsnorm(x, self.weight, self.eps)
            return ref_rmsnorm(x, self.weight, self.eps)
        if kernels is not None and x.dim() == 2:
            return kernels.fused_add_rmsnorm(x, residual, self.weight, self.eps)
        return ref_fused_add_rmsnorm(x, residual, self.weight, self.eps)


def qk_norm(qkv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head q_norm / k_norm: q [T, Hq, D] and k [T, Hkv, D], views of the fused projection's output
    ``qkv`` [T, (Hq + 2 Hkv) D] (q heads, k heads, v heads). With kernels on CUDA, both in one Triton launch in
    place in qkv (``roofline.kernels.qk_norm``; returns the same views, now normed), else ``q_norm(q), k_norm(k)``.
    Numerics are HF ``Qwen3RMSNorm``'s either way.

    Not on LlamaAttention's path: the model hands the norms to the attention backend (``QKNorm``), and the Triton
    backend runs them inside ``rope_and_cache``. This is the unfused two-step form, kept with its tests."""
    if (dispatch.kernels_for(qkv) is not None and q_norm.weight.dtype == k_norm.weight.dtype == qkv.dtype
            and q_norm.eps == k_norm.eps and q.data_ptr() == qkv.data_ptr()
            and k.data_ptr() == qkv.data_ptr() + q.shape[1] * q.shape[2] * qkv.element_size()):
        from roofline.kernels.qk_norm import qk_rmsnorm_

        qk_rmsnorm_(qkv, q.shape[1], k.shape[1], q.shape[2], q_norm.weight, k_norm.weight, q_norm.eps)
        return q, k
    return q_norm(q), k_norm(k)
