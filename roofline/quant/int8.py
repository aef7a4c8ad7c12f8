"""``--quantization int8``: INT8 weights, 16-bit activations (W8A16), symmetric per output channel.

``W[n, k] ~= q[n, k] * s[n]`` with ``s[n] = max_k |W[n, k]| / 127`` (round to nearest). Weight-only: the
activations stay in the model dtype, the weight is dequantized in registers (GPU: the Triton W8A16 GEMM).
On CPU the same weights run W8A8 dynamic instead (activations quantized per token, ``torch._int_mm``;
``roofline.kernels.cpu_int8``): torch's CPU W8A16 kernel was slower than fp32. Halves the bytes a decode step
streams against bf16 (1 byte per weight + 4 bytes per row).

The LM head on CPU (``CpuW8A8LMHeadMethod``, both INT8 formats): the same W8A8 product on an INT8 copy of
the head. The head is the step's largest GEMM (SmolLM2-135M: 49,152 x 576, tied to the embedding), so a
16-bit head left half the int8 step in one fp32/bf16 GEMV (issue 32). The float table stays for the
embedding lookup (the tie is kept); GPUs keep the 16-bit head.
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
        _pack_tiles(layer)

    def apply(self, layer, x, bias=None):
        from roofline.kernels import linear_dispatch as gemm

        return gemm.w8a16(x, layer, bias)


class CpuW8A8LMHeadMethod:
    """The LM head as INT8 W8A8 dynamic on CPU (``roofline.kernels.cpu_int8``), a 16-bit head elsewhere.

    ``process_weights_after_loading(head)``: on CPU, quantizes ``head.weight`` [V_p, K] (float, possibly the
    embedding's table, which stays as it is for the lookup) per row into ``head.qweight`` int8 [V_p, K] and
    ``head.weight_scale`` float32 [V_p] (``quantize_int8_per_channel``, the linears' rounding); on other
    devices it does nothing. Idempotent (a reload quantizes the new table).
    ``apply(head, hidden)``: hidden [N, K] -> logits [N, V_p] float32: the W8A8 product where ``qweight``
    exists, else ``F.linear`` on ``head.weight`` (in ``hidden``'s dtype, as the 16-bit head).
    Quality (README, CPU quality rows): ``roofline eval`` KL against fp32 rises a little over the int8 linears'.
    """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.weight.device.type != "cpu":
            return
        cw = quantize_int8_per_channel(layer.weight.detach())
        register_frozen(layer, "qweight", cw.q.to(torch.int8).contiguous())
        register_frozen(layer, "weight_scale", cw.scales.float().contiguous())
        _pack_tiles(layer)

    def apply(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        if getattr(layer, "qweight", None) is None:
            return torch.nn.functional.linear(hidden, layer.weight)
        from roofline.kernels.cpu_int8 import w8a8_dynamic_linear

        # fp32 in gives fp32 logits (the same codes: the activations are quantized from fp32 either way).
        return w8a8_dynamic_linear(hidden.float(), layer.qweight, layer.weight_scale,
                                   packed=getattr(layer, "tile_qweight", None))


def _pack_tiles(layer: nn.Module) -> None:
    """On a CPU with AMX-INT8 or AVX-512 VNNI: ``layer.tile_qweight``, ``qweight``'s tiles
    (``cpu_int8.tile_pack_int8``), which W8A8 products of 2 or more rows read (a second copy of the codes: not
    counted in ``weight_bytes``, as the bf16 layers' packed copy); None elsewhere."""
    q = layer.qweight
    layer.tile_qweight = None
    if q.device.type == "cpu":
        from roofline.kernels.cpu_int8 import tile_pack_int8

        layer.tile_qweight = tile_pack_int8(q)


class Int8Config(ChannelQuantConfig):
    """Weight-only INT8 for every linear layer (embeddings stay 16-bit; lm_head too, except on CPU:
    ``CpuW8A8LMHeadMethod``)."""

    name = "int8"
    linear_method_cls = Int8LinearMethod
    lm_head_method_cls = CpuW8A8LMHeadMethod

