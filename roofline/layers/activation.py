"""SwiGLU's gate: silu(gate) * up over a fused gate_up projection (Shazeer 2020)."""

from __future__ import annotations

import torch

from roofline.kernels.activation import ref_silu_and_mul
from roofline.layers import dispatch


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]."""
    kernels = dispatch.kernels_for(x)
    if kernels is not None:
        return kernels.silu_and_mul(x)
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        from roofline.kernels.cpu_bf16 import silu_and_mul as cpu_silu_and_mul

        if (y := cpu_silu_and_mul(x)) is not None:
            return y
    return ref_silu_and_mul(x)
