"""Weight formats of the routed experts (``FusedMoE``), behind the same seam as linear layers: a
``FusedMoEMethod`` creates the stacked expert weights, turns the loaded ones into what the kernel reads, and
applies the experts (vLLM's ``FusedMoEMethodBase``). A ``QuantConfig`` picks one by its name
(``QuantConfig.get_moe_method``), so a model builds ``FusedMoE(..., quant_config=cfg)`` and never branches
on the format.

    None (16-bit)  w13_weight [E, 2I, H], w2_weight [E, H, I] in the model dtype
    int8           W8A16: int8 codes, float32 scale per output channel of each expert (quantized at load)
    fp8            W8A16 with E4M3 codes (the same layout; on GPUs with FP8 conversions: sm_89+)

Only load-time quantization of a 16-bit checkpoint (or dummy weights) is built; a checkpoint whose experts
are already quantized is refused by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from roofline.quant.base import WeightLoader, register_frozen, set_weight_attrs


class FusedMoEMethod(ABC):
    """How one ``FusedMoE`` layer stores its experts and runs them."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        """Register ``w13_weight`` [E, 2I, H] (gate rows, then up rows) and ``w2_weight`` [E, H, I] on
        ``layer``: E this rank's experts, I this rank's share of each expert's width."""
        w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size_per_partition, hidden_size,
                                       dtype=params_dtype), requires_grad=False)
        w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size_per_partition,
                                      dtype=params_dtype), requires_grad=False)
        for p in (w13, w2):
            set_weight_attrs(p, {"weight_loader": weight_loader})
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        """Called once after loading (quantize the experts)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_weights [T, k] float32, topk_ids [T, k] local ids (-1: not on this rank) -> [T, H]
        (this rank's partial sum: the layer reduces across ranks)."""

    def expert_bytes(self, layer: nn.Module) -> int:
        """Bytes one local expert's weights occupy (what reading it once costs)."""
        total = sum(p.numel() * p.element_size() for n, p in layer.named_parameters(recurse=False)
                    if n.startswith(("w13", "w2")))
        return total // layer.num_local_experts


def _experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
             w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton fused kernel on CUDA (when kernels are on), else the expert loop (CPU) or its sync-free
    dense twin (CUDA with the kernels off, so CUDA graphs still capture the step)."""
    from roofline.layers.dispatch import kernels_for

    if kernels_for(x) is not None:
        from roofline.kernels.fused_moe import fused_moe

        return fused_moe(x.contiguous(), w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    from roofline.kernels.fused_moe import ref_fused_moe, ref_fused_moe_dense

    if x.is_cuda:  # kernels off on a GPU: the loop's shapes depend on the routing (a host sync per expert)
        return ref_fused_moe_dense(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    return ref_fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)


class UnquantizedFusedMoEMethod(FusedMoEMethod):
    """16-bit experts (the model dtype)."""

    def apply(self, layer, x, topk_weights, topk_ids):
        return _experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)


class ChannelFusedMoEMethod(FusedMoEMethod):
    """Weight-only 8-bit experts, symmetric per output channel of each expert: ``W[e, n, k] ~= q * s[e, n]``.
    Quantized at load from the 16-bit weights. ``quantize`` is the per-channel quantizer of ``[N, K]``."""

    code_dtype: torch.dtype

    @staticmethod
    @abstractmethod
    def quantize(w: torch.Tensor, amax: torch.Tensor | None = None) -> Any:
        """[N, K] -> ``ChannelWeight`` (codes [N, K], scales [N] float32)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for name in ("w13", "w2"):
            w = getattr(layer, f"{name}_weight").data  # [E, N, K]
            amax = w.float().abs().amax(dim=2)  # [E, N]
            if name == "w2" and layer.tp_size > 1:  # K (the expert's width) is split: the whole row's amax
                from roofline.distributed.communication import tensor_parallel_all_reduce

                tensor_parallel_all_reduce(amax, op="max")
            parts = [self.quantize(w[e], amax[e]) for e in range(w.shape[0])]
            delattr(layer, f"{name}_weight")
            register_frozen(layer, f"{name}_weight", torch.stack([p.q for p in parts]))
            register_frozen(layer, f"{name}_weight_scale", torch.stack([p.scales for p in parts]).float())

    def apply(self, layer, x, topk_weights, topk_ids):
        return _experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.w13_weight_scale,
                        layer.w2_weight_scale)


class Int8FusedMoEMethod(ChannelFusedMoEMethod):
    code_dtype = torch.int8

    @staticmethod
    def quantize(w, amax=None):
        from roofline.quant.quantize import quantize_int8_per_channel

        return quantize_int8_per_channel(w, amax)


class Fp8FusedMoEMethod(ChannelFusedMoEMethod):
    code_dtype = torch.float8_e4m3fn

    @staticmethod
    def quantize(w, amax=None):
        from roofline.quant.quantize import quantize_fp8_per_channel

        return quantize_fp8_per_channel(w, amax)


# --quantization name -> its expert method (formats without one are refused by name).
MOE_METHODS: dict[str, type[FusedMoEMethod]] = {"int8": Int8FusedMoEMethod, "fp8": Fp8FusedMoEMethod}


def get_moe_method(quant_config: Any, prefix: str) -> FusedMoEMethod:
    """The expert method for ``quant_config`` (None: 16-bit).

    Raises:
        ValueError: a format without an expert kernel, or a checkpoint whose experts are pre-quantized (names
            the format and the formats that have one).
    """
    if quant_config is None:
        return UnquantizedFusedMoEMethod()
    name = getattr(quant_config, "name", type(quant_config).__name__)
    if name not in MOE_METHODS:
        raise ValueError(f"{prefix}: quantization {name!r} has no expert (MoE) kernel; formats with one: "
                         f"{', '.join(MOE_METHODS)} (or none: 16-bit experts)")
    if getattr(quant_config, "checkpoint", None) is not None:
        raise ValueError(f"{prefix}: pre-quantized expert weights are not supported; load the 16-bit checkpoint "
                         f"and quantize at load with --quantization {' or '.join(MOE_METHODS)}")
    return MOE_METHODS[name]()
