"""``--quantization smoothquant``: INT8 weights per output channel and INT8 activations per token (W8A8),
after SmoothQuant's smoothing (Xiao et al. 2023, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models", ICML).

Smoothing divides each input channel j of the activations by ``s_j = max|X_j|^a / max|W_j|^(1-a)`` (``a``
= alpha, 0.5 by default) and multiplies the weight's column j by it, which is exact in real arithmetic; the
division is folded into the preceding RMSNorm's weight (``roofline quantize --method smoothquant``, which
needs calibration activations, ``roofline.quant.calibrate.smooth``). The checkpoint then holds the smoothed
norms and INT8 weights in compressed-tensors ``int-quantized`` layout (llm-compressor's W8A8 scheme), so
loading it is plain W8A8. ``--quantization smoothquant`` on an unquantized model has no activations to
smooth with, so it quantizes at load without smoothing (alpha = 0) and says so.

At run time: ``x`` is quantized per token (symmetric, amax / 127), the product accumulates exactly in int32
(the Triton INT8 tensor-core GEMM on GPUs, ``torch._int_mm`` on CPU) and the epilogue applies
``s_x[m] * s_w[n]``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from roofline.quant.base import ChannelQuantConfig, QuantizedLinearMethod, register_frozen
from roofline.quant.int8 import CpuW8A8LMHeadMethod
from roofline.quant.quantize import ChannelWeight, quantize_int8_per_channel

logger = logging.getLogger(__name__)


class SmoothQuantLinearMethod(QuantizedLinearMethod):
    """INT8 W8A8. Stores ``qweight`` int8 [N, K] and ``weight_scale`` float32 [N]."""

    layout = "int8-dynamic"

    def quantize(self, weight: torch.Tensor, layer: nn.Module) -> ChannelWeight:
        return quantize_int8_per_channel(weight)

    def set_weights(self, layer: nn.Module, canonical: ChannelWeight) -> None:
        from roofline.kernels import linear_dispatch as gemm

        for name, tensor in gemm.prepare_int8_w8a8(canonical).items():
            register_frozen(layer, name, tensor)

    def input_quant(self, layer, num_tokens):
        from roofline.kernels import linear_dispatch as gemm

        return gemm.input_quant_format("smoothquant", num_tokens, *layer.qweight.shape, layer.qweight.device)

    def apply(self, layer, x, bias=None):
        from roofline.kernels import linear_dispatch as gemm

        return gemm.int8_w8a8(x, layer, bias)


class SmoothQuantConfig(ChannelQuantConfig):
    """INT8 W8A8 for every linear layer (embeddings stay 16-bit; lm_head too, except on CPU, unsmoothed:
    ``roofline.quant.int8.CpuW8A8LMHeadMethod``)."""

    name = "smoothquant"
    linear_method_cls = SmoothQuantLinearMethod
    lm_head_method_cls = CpuW8A8LMHeadMethod

    def __init__(self, checkpoint=None):
        super().__init__(checkpoint)
        if checkpoint is None:
            logger.info("smoothquant at load: INT8 W8A8 without smoothing (no calibration activations); "
                        "`roofline quantize --quantization smoothquant` writes a smoothed checkpoint")
