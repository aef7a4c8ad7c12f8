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

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from roofline.kernels.cpu_bf16 import pack_layer
from roofline.kernels.cpu_f32 import layer_linear

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

    def input_quant(self, layer: nn.Module, num_tokens: int) -> str | None:
        """The per-token format ("int8" / "fp8") in which :meth:`apply` would quantize an input of ``num_tokens``
        rows in a pass of its own, so that the producer of that input may write the codes instead
        (``roofline.kernels.act_quant.QuantizedActivation``, which ``apply`` then accepts as ``x``); None (the
        default) where ``apply`` takes 16-bit x."""
        return None

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes a forward pass reads for this layer's weights (what the bound model counts)."""
        return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))


def create_dense_weight(layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                        params_dtype: torch.dtype, weight_loader: WeightLoader) -> None:
    """Register a dense ``weight`` [sum(output_partition_sizes), input_size_per_partition] on ``layer``."""
    weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
                          requires_grad=False)
    set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, "weight_loader": weight_loader})
    layer.register_parameter("weight", weight)


class UnquantizedLinearMethod(LinearMethod):
    """A dense ``weight`` [out, in] in the model dtype; ``apply`` is one GEMM: cuBLAS, or on GPUs at decode sizes
    our split-K GEMV where the measured dispatch table says it is faster (``roofline.quant.gemm.dense_linear``).
    bf16 on a CPU with bf16 units: oneDNN with the weight packed once after loading (``packed_weight``, an opaque
    copy: the linears' memory twice; ``roofline.kernels.cpu_bf16``), the same numerics as ``F.linear``; at one row
    the C++ GEMV (one fp32 rounding too, in another summation order)."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype,
                       weight_loader):
        create_dense_weight(layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader)

    def process_weights_after_loading(self, layer):
        pack_layer(layer)

    def apply(self, layer, x, bias=None):
        if (out := layer_linear(layer, x, bias)) is not None:
            return out
        from roofline.kernels.linear_dispatch import dense_linear

        return dense_linear(x, layer.weight, bias)


class QuantConfig(ABC):
    """A weight format: parsed from a checkpoint's ``quantization_config`` or chosen by a flag.

    Each registered format (``roofline.quant.registry``) builds its config with ``from_config``, the shape of
    vLLM's ``QuantizationConfig.from_config``.
    """

    name: str = "abstract"

    @classmethod
    def from_config(cls, checkpoint: Any = None, group_size: int = 128) -> QuantConfig:
        """The config for a checkpoint's parsed ``quantization_config`` (``formats.QuantSpec``), or, with
        ``checkpoint`` None, for quantizing an unquantized model at load (``group_size``: INT4 only).

        Raises:
            ValueError: the format cannot do what is asked (a checkpoint-only format without a checkpoint,
                a bad group size), naming the value and what is allowed.
        """
        raise ValueError(f"quantization {cls.name!r} has no from_config")

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        """The method for the linear layer at ``prefix`` (e.g. ``model.layers.0.self_attn.qkv_proj``);
        return ``UnquantizedLinearMethod()`` for layers the format leaves in 16 bits (``lm_head``)."""

    # The LM head's method class (``process_weights_after_loading(head)``, ``apply(head, hidden)``), or None for the
    # 16-bit head. Only the INT8 formats have one: W8A8 on CPU (``roofline.quant.int8.CpuW8A8LMHeadMethod``).
    lm_head_method_cls: type | None = None

    def get_lm_head_method(self) -> Any:
        """A fresh ``lm_head_method_cls()``, or None for the 16-bit head (``F.linear`` on its weight, which may be
        the embedding's)."""
        return self.lm_head_method_cls() if self.lm_head_method_cls is not None else None


def checkpoint_only(name: str, checkpoint: Any) -> Any:
    """``checkpoint``, or a ValueError saying that ``name`` reads a checkpoint quantized in that format."""
    if checkpoint is None:
        raise ValueError(f"quantization {name!r} reads a checkpoint quantized in that format, but this "
                         f"model has no quantization_config; to quantize at load use int4, int8, fp8 or "
                         f"smoothquant, or write a checkpoint with `roofline quantize`")
    return checkpoint


class FormatQuantConfig(QuantConfig):
    """A format that gives every linear layer the same method (``linear_method``), except the layers a
    checkpoint's ignore list leaves in 16 bits; lm_head and the embeddings are never quantized.

    Attributes:
        checkpoint: the parsed ``quantization_config`` (``formats.QuantSpec``), or None to quantize at load.
    """

    def __init__(self, checkpoint: Any = None):
        self.checkpoint = checkpoint

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        if self.checkpoint is not None and is_ignored(self.checkpoint, prefix):
            return UnquantizedLinearMethod()
        return self.linear_method()

    @abstractmethod
    def linear_method(self) -> LinearMethod:
        """A fresh method for one quantized linear layer."""


class ChannelQuantConfig(FormatQuantConfig):
    """The per-output-channel 8-bit family (int8 W8A16, fp8 W8A8, smoothquant INT8 W8A8): one config, and a
    format of the family declares only its ``name`` and ``linear_method_cls``. Quantized at load, or read from
    a compressed-tensors checkpoint of the matching scheme (``roofline.quant.compressed_tensors``).
    """

    linear_method_cls: type[QuantizedLinearMethod]

    @classmethod
    def from_config(cls, checkpoint: Any = None, group_size: int = 128) -> ChannelQuantConfig:
        return cls(checkpoint)

    def linear_method(self) -> LinearMethod:
        return self.linear_method_cls(self.checkpoint)


def channel_amax(weight: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """max_k |W[n, k]| per output channel [N] fp32, over the whole row: a row-parallel layer's rank holds
    only K / tp of it, so the ranks take the maximum together (one all-reduce at load) and quantize their
    shards with the scales the unsharded weight would have (TP output then matches one process's)."""
    amax = weight.float().abs().amax(dim=1)
    if getattr(layer, "tp_size", 1) > 1 and getattr(layer, "input_is_parallel", False):
        from roofline.distributed.communication import tensor_parallel_all_reduce

        tensor_parallel_all_reduce(amax, op="max")
    return amax


class QuantizedLinearMethod(LinearMethod):
    """Shared life cycle of the quantized formats.

    A layer's weight arrives in one of two ways:
    - quantize at load (``checkpoint is None``): ``create_weights`` registers a dense ``weight`` [N, K] in the
      model dtype, the loader fills it (checkpoint, GGUF or dummy values), and
      ``process_weights_after_loading`` quantizes it with ``quantize`` (round-to-nearest, or FP8 dynamic), as
      vLLM's ``--quantization fp8`` does on an unquantized model;
    - a pre-quantized checkpoint: ``create_checkpoint_weights`` registers the tensors of the published layout
      (GPTQ, AWQ, compressed-tensors) and ``unpack`` turns them into the canonical form.

    Either way the canonical form (``roofline.quant.quantize``) goes to ``set_weights``, which registers what
    ``apply`` reads and drops everything else, so ``weight_bytes`` counts only the bytes a forward pass reads.
    """

    def __init__(self, checkpoint: Any = None):
        self.checkpoint = checkpoint

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype,
                       weight_loader):
        if self.checkpoint is None:
            create_dense_weight(layer, input_size_per_partition, output_partition_sizes, params_dtype,
                                weight_loader)
        else:
            self.create_checkpoint_weights(layer, input_size_per_partition, output_partition_sizes,
                                           params_dtype, weight_loader)

    def create_checkpoint_weights(self, layer: nn.Module, input_size_per_partition: int,
                                  output_partition_sizes: list[int], params_dtype: torch.dtype,
                                  weight_loader: WeightLoader) -> None:
        create_layout_weights(layer, self.layout, input_size_per_partition, output_partition_sizes,
                              self.checkpoint.group_size, weight_loader)

    @property
    def layout(self) -> str:
        """The checkpoint layout this method reads (a ``formats.TENSOR_LAYOUTS`` key)."""
        raise ValueError(f"{type(self).__name__} cannot load a pre-quantized checkpoint")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        names = [n for n, _ in layer.named_parameters(recurse=False) if n != "bias"]
        if self.checkpoint is None:
            canonical = self.quantize(layer.weight.data, layer)
        else:
            canonical = self.unpack(layer)
        for name in names:
            delattr(layer, name)
        self.set_weights(layer, canonical)

    def quantize(self, weight: torch.Tensor, layer: nn.Module) -> Any:
        """Dense ``weight`` [N, K] -> the canonical quantized form (load-time quantization)."""
        raise NotImplementedError

    def unpack(self, layer: nn.Module) -> Any:
        """The checkpoint tensors registered by ``create_checkpoint_weights`` -> the canonical form."""
        from roofline.quant import formats

        tensors = {name: p.data for name, p in layer.named_parameters(recurse=False) if name != "bias"}
        name = getattr(layer, "prefix", "") or "layer"
        spec = self.checkpoint
        if spec.format == "gptq":
            return formats.unpack_gptq(tensors, spec.group_size, checkpoint_format=spec.checkpoint_format,
                                       name=name)
        if spec.format == "awq":
            return formats.unpack_awq(tensors, spec.group_size, name=name)
        return formats.unpack_compressed_tensors(tensors, spec.scheme, name=name)

    @abstractmethod
    def set_weights(self, layer: nn.Module, canonical: Any) -> None:
        """Register on ``layer`` the tensors ``apply`` reads (as frozen parameters), from the canonical form."""


def register_frozen(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """``tensor`` as a frozen parameter of ``layer`` (moves with the module, counted by ``weight_bytes``)."""
    layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


def create_layout_weights(layer: nn.Module, layout: str, input_size: int, output_partition_sizes: list[int],
                          group_size: int | None, weight_loader: WeightLoader) -> None:
    """Register the tensors of a published checkpoint layout (``roofline.quant.formats.TENSOR_LAYOUTS``) for
    a linear of ``sum(output_partition_sizes)`` x ``input_size``, named as the checkpoint names them
    (``qweight``, ``qzeros``, ``scales``, ``g_idx``; ``weight``, ``weight_scale``; ``weight_packed``...).

    Each parameter carries ``output_dim`` / ``input_dim`` / ``packed_dim`` / ``pack_factor`` so the layer's
    ``weight_loader`` can place the shards of fused q/k/v and gate/up inside packed tensors. Tensors with no
    output dim (``g_idx``, ``weight_shape``) are the same for every shard and are loaded whole. Float tensors
    (scales) are held in float32, so fp16, bf16 or fp32 checkpoint scales load exactly.
    """
    from roofline.quant.formats import TENSOR_LAYOUTS

    n = sum(output_partition_sizes)
    gs = input_size if group_size in (None, -1) else group_size
    for t in TENSOR_LAYOUTS[layout]:
        dtype = torch.float32 if t.dtype.is_floating_point and t.dtype.itemsize > 1 else t.dtype
        param = nn.Parameter(torch.zeros(t.shape(n, input_size, gs), dtype=dtype), requires_grad=False)
        attrs: dict[str, Any] = {"pack_factor": t.pack_factor, "packed_dim": t.packed_dim}
        if t.output_dim is not None:
            attrs.update(output_dim=t.output_dim, weight_loader=weight_loader)
            if t.input_dim is not None:
                attrs["input_dim"] = t.input_dim
        else:
            attrs["weight_loader"] = _load_shape if t.suffix == "weight_shape" else _load_whole
        set_weight_attrs(param, attrs)
        layer.register_parameter(t.suffix, param)


def _load_whole(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """A tensor every shard of a fused layer shares (GPTQ ``g_idx``): each shard's copy must be the same.

    Raises:
        ValueError: a shape other than the parameter's, or a shard whose copy differs from an earlier
            shard's (q/k/v with different act-order permutations cannot share one fused weight).
    """
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint has {tuple(loaded.shape)}, the model expects {tuple(param.shape)}")
    if param.dtype.is_floating_point != loaded.dtype.is_floating_point:
        raise ValueError(f"checkpoint has dtype {loaded.dtype}, the parameter holds {param.dtype}")
    if getattr(param, "whole_loaded", False):
        if not torch.equal(param.data, loaded.to(param.device, param.dtype)):
            raise ValueError(f"shard {shard_id!r} differs from the fused layer's earlier shards; roofline fuses "
                             f"them into one weight, which needs one shared copy")
        return
    param.data.copy_(loaded)
    param.whole_loaded = True


def _load_shape(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """compressed-tensors ``weight_shape`` [2] = (N, K) of one shard: the shards of a fused layer share K (checked),
    and each names its own N (the fused N comes from the packed rows)."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint has {tuple(loaded.shape)}, the model expects {tuple(param.shape)}")
    if getattr(param, "whole_loaded", False) and int(param.data[1]) != int(loaded[1]):
        raise ValueError(f"shard {shard_id!r} has K={int(loaded[1])}, an earlier shard K={int(param.data[1])}")
    param.data.copy_(loaded)
    param.whole_loaded = True


# Our fused modules and the Hugging Face modules they hold (a checkpoint's ignore list names the latter).
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def is_ignored(spec: Any, prefix: str) -> bool:
    """Whether the checkpoint leaves the linear at ``prefix`` (our module name) unquantized: its
    ``ignore`` list (names or compressed-tensors ``re:`` patterns) names every HF module the layer fuses.

    Raises:
        ValueError: the list names some but not all of a fused layer's parts (q/k/v or gate/up), which one
            fused weight cannot represent.
    """
    parent, _, leaf = prefix.rpartition(".")
    parts = [f"{parent}.{p}" if parent else p for p in _FUSED_PARTS.get(leaf, (leaf,))]
    hits = [any(_matches(p, pat) for pat in spec.ignore) for p in parts]
    if any(hits) and not all(hits):
        raise ValueError(f"quantization_config.ignore leaves {[p for p, h in zip(parts, hits, strict=False) if h]} unquantized "
                         f"but not {[p for p, h in zip(parts, hits, strict=False) if not h]}; roofline fuses them into {prefix}")
    return all(hits)
