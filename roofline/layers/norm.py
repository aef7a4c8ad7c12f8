"""RMSNorm (Zhang & Sennrich 2019), with the residual add fused in as in vLLM.

Numerics follow Hugging Face ``LlamaRMSNorm`` (see ``roofline.kernels.rmsnorm``): normalize in fp32, cast
back, then scale by the weight. With kernels enabled on CUDA the fused Triton kernel runs, else its
``ref_`` twin.
"""

from __future__ import annotations

import torch
from torch import nn

from roofline.kernels.rmsnorm import ref_fused_add_rmsnorm, ref_rmsnorm
from roofline.layers import dispatch


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

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
        return ref_fused_add_rmsnorm(x, residual, self.weight, self.eps)
