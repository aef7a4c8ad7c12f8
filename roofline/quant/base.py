"""The seam every weight format plugs into (the vLLM pattern: ``LinearMethodBase`` / ``QuantizationConfig``).

A linear layer owns no weight of its own. Its ``LinearMethod``:
1. ``create_weights`` registers the parameters the format stores (for INT4: packed weights, scales, zero
   points) on the layer, each with a ``weight_loader`` that knows how to place a checkpoint tensor;
2. ``process_weights_after_loading`` turns what was loaded into what the kernel reads (repacking,
   transposing), once;
3. ``apply`` computes ``x @ W^T + b`` from them.

A ``QuantConfig`` picks the method per layer (by its Hugging Face ``prefix``), so a model file builds
``QKVParallelLinear(..., quant_config=cfg, prefix=...)`` and never branches on the format.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

WeightLoader = Callable[..., None]


def set_weight_attrs(param: nn.Parameter, attrs: dict[str, Any]) -> None:
    """Attach loading metadata (``weight_loader``, ``output_dim``, ``input_dim``) to a parameter."""
    for key, value in attrs.items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


class LinearMethod(ABC):
    """How one linear layer stores its weights and multiplies by them."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        """Register this format's parameters on ``layer``.

        Args:
            input_size_per_partition: columns this rank multiplies (``in_features / tp`` for row-parallel).
            output_partition_sizes: rows of each logical output on this rank (q/k/v or gate/up sizes, or
                one entry), summing to the layer's output rows on this rank.
            params_dtype: dtype of unquantized parameters (the model dtype).
            weight_loader: the layer's loader, to attach to every parameter (``set_weight_attrs``).
        """

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        """Called once after every checkpoint tensor is loaded (repack, transpose, compute scales)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: [num_tokens, input_size_per_partition] -> [num_tokens, sum(output_partition_sizes)]."""

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes a forward pass reads for this layer's weights (what the bound model counts)."""
        return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))


class UnquantizedLinearMethod(LinearMethod):
    """A dense ``weight`` [out, in] in the model dtype; ``apply`` is one GEMM (cuBLAS on GPUs, whose M = 1
    streaming was measured as fast as our Triton GEMV, see docs/kernels.md)."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype,
                       weight_loader):
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition,
                                          dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, "weight_loader": weight_loader})
        layer.register_parameter("weight", weight)

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)


class QuantConfig(ABC):
    """A weight format: parsed from a checkpoint's ``quantization_config`` or chosen by a flag."""

    name: str = "abstract"

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        """The method for the linear layer at ``prefix`` (e.g. ``model.layers.0.self_attn.qkv_proj``);
        return ``UnquantizedLinearMethod()`` for layers the format leaves in 16 bits (``lm_head``)."""
