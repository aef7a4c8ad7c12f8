"""``--quantization fp8``: FP8 E4M3 weights per output channel, FP8 E4M3 activations per token (W8A8).

Weights: ``W[n, k] ~= e4m3(W[n, k] / s[n]) * s[n]`` with ``s[n] = max_k |W[n, k]| / 448``. Activations are
rounded to E4M3 per token at run time with ``s[m] = max_k |x[m, k]| / 448`` (dynamic: no calibration), so the
matmul runs on FP8 tensor cores with float32 accumulation (``torch._scaled_mm`` with row-wise scales on
Hopper) and the epilogue applies ``s[m] * s[n]``. The same layout as llm-compressor's ``FP8_DYNAMIC``
scheme (compressed-tensors ``float-quantized``). Off Hopper/Ada (and on CPU) the arithmetic is emulated in
float32 and the start-up log says so.
"""

from __future__ import annotations

import torch
from torch import nn

from roofline.quant.base import ChannelQuantConfig, QuantizedLinearMethod, channel_amax, register_frozen
from roofline.quant.quantize import ChannelWeight, quantize_fp8_per_channel


class Fp8LinearMethod(QuantizedLinearMethod):
    """FP8 W8A8. Stores ``qweight`` float8_e4m3fn [N, K] (row-major, so ``qweight.t()`` is the column-major
    operand ``_scaled_mm`` wants) and ``weight_scale`` float32 [N]."""

    layout = "fp8-dynamic"

    def quantize(self, weight: torch.Tensor, layer: nn.Module) -> ChannelWeight:
        return quantize_fp8_per_channel(weight, channel_amax(weight, layer))

    def set_weights(self, layer: nn.Module, canonical: ChannelWeight) -> None:
        from roofline.kernels import linear_dispatch as gemm

        q = canonical.q.to(torch.float8_e4m3fn).contiguous()
        register_frozen(layer, "qweight", q)
        register_frozen(layer, "weight_scale", canonical.scales.float().contiguous())
        # The emulated path's float64 copy of the E4M3 values: not a parameter (no FP8 device reads it).
        layer.fp8_emulation_weight = None if gemm.fp8_tensor_cores(q.device) else gemm.fp8_emulation_weight(q)

    def input_quant(self, layer, num_tokens):
        from roofline.kernels import linear_dispatch as gemm

        return gemm.input_quant_format("fp8", num_tokens, *layer.qweight.shape, layer.qweight.device)

    def apply(self, layer, x, bias=None):
        from roofline.kernels import linear_dispatch as gemm

        return gemm.fp8_w8a8(x, layer.qweight, layer.weight_scale, bias, layer.fp8_emulation_weight)


class Fp8Config(ChannelQuantConfig):
    """FP8 W8A8 dynamic for every linear layer (lm_head and embeddings stay 16-bit)."""

    name = "fp8"
    linear_method_cls = Fp8LinearMethod
