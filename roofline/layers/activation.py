"""SwiGLU's gate: silu(gate) * up over a fused gate_up projection (Shazeer 2020)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from roofline.kernels.act_quant import QuantizedActivation
from roofline.kernels.activation import ref_silu_and_mul
from roofline.layers import dispatch

if TYPE_CHECKING:
    from roofline.layers.linear import LinearBase


def silu_and_mul(x: torch.Tensor, quant_for: LinearBase | None = None) -> torch.Tensor | QuantizedActivation:
    """x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate].

    ``quant_for``: the linear layer the result feeds (down_proj). Where it would quantize its input per token in a
    pass of its own (``LinearBase.input_quant``), the codes are written by this kernel instead
    (``roofline.kernels.act_quant.silu_and_mul_quant``, bit-identical) and a ``QuantizedActivation`` returned."""
    if quant_for is not None and (fmt := quant_for.input_quant(x)) is not None:
        from roofline.kernels.act_quant import silu_and_mul_quant

        return QuantizedActivation(*silu_and_mul_quant(x, fmt), x.dtype)
    kernels = dispatch.kernels_for(x)
    if kernels is not None:
        return kernels.silu_and_mul(x)
    if x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu":
        from roofline.kernels.cpu_bf16 import silu_and_mul as cpu_silu_and_mul

        if (y := cpu_silu_and_mul(x)) is not None:
            return y
    return ref_silu_and_mul(x)
