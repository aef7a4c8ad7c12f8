"""``--quantization int8``: INT8 weights, 16-bit activations (W8A16), symmetric per output channel.

``W[n, k] ~= q[n, k] * s[n]`` with ``s[n] = max_k |W[n, k]| / 127`` (round to nearest). Weight-only: the
activations stay in the model dtype, the weight is dequantized in registers (GPU: the Triton W8A16 GEMM).
On CPU the same weights run W8A8 dynamic instead (activations quantized per token, ``torch._int_mm``;
``roofline.kernels.cpu_int8``): torch's CPU W8A16 kernel was slower than fp32. Halves the bytes a decode step
streams against bf16 (1 byte per weight + 4 bytes per row).
"""

from __future__ import annotations

import torch
from torch import nn

from roofline.quant.base import ChannelQuantConfig, QuantizedLinearMethod, channel_amax, register_frozen
from roofline.quant.quantize import ChannelWeight, quantize_int8_per_channel


class Int8LinearMethod(QuantizedLinearMethod):
    """W8A16. Stores ``qweight`` int8 [N, K] and ``weight_scale`` float32 [N]."""

    layout = "w8a16-int8"  # compressed-tensors pack-quantized, the INT8 weight-only layout vLLM reads

    def quantize(self, weight: torch.Tensor, layer: nn.Module) -> ChannelWeight:
        return quantize_int8_per_channel(weight, channel_amax(weight, layer))

    def set_weights(self, layer: nn.Module, canonical: ChannelWeight) -> None:
        from roofline.kernels import linear_dispatch as gemm

        for name, tensor in gemm.prepare_w8a16(canonical).items():
            register_frozen(layer, name, tensor)

    def apply(self, layer, x, bias=None):
        from roofline.kernels import linear_dispatch as gemm

        return gemm.w8a16(x, layer, bias)


class Int8Config(ChannelQuantConfig):
    """Weight-only INT8 for every linear layer (lm_head and embeddings stay 16-bit)."""

    name = "int8"
    linear_method_cls = Int8LinearMethod

