"""RMSNorm (Zhang & Sennrich 2019), with the residual add fused in as in vLLM.

Numerics follow Hugging Face ``LlamaRMSNorm``: normalize in fp32, cast back, then scale by the weight.
On CUDA with Triton available, the fused kernel in ``roofline.kernels.rmsnorm`` is used.
"""

from __future__ import annotations

import torch
from torch import nn

from roofline.layers import dispatch


def ref_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [..., hidden]. With ``residual``, returns (rmsnorm(x + residual), x + residual)."""
        kernels = dispatch.kernels_for(x)
        if residual is None:
            if kernels is not None and x.dim() == 2:
                return kernels.rmsnorm(x, self.weight, self.eps)
            return ref_rmsnorm(x, self.weight, self.eps)
        if kernels is not None and x.dim() == 2:
            return kernels.fused_add_rmsnorm(x, residual, self.weight, self.eps)
        residual = x + residual
        return ref_rmsnorm(residual, self.weight, self.eps), residual
