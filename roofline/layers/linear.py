"""Linear layers in the vLLM pattern: tensor-parallel shapes, a pluggable ``LinearMethod``, and a
``weight_loader`` on every parameter that places one checkpoint tensor (or one shard of a fused one).

Weights are [out_features, in_features] as in Hugging Face checkpoints. Sharding (Shoeybi et al. 2019,
Megatron-LM): column-parallel layers split the output rows across ranks and need no communication;
row-parallel layers split the input columns and all-reduce their partial sums. A transformer block pairs
them (qkv column / o row, gate_up column / down row), so each block all-reduces twice.

    ReplicatedLinear            every rank holds the whole weight
    ColumnParallelLinear        rows split: rank r holds rows [r * out/tp, (r + 1) * out/tp)
    MergedColumnParallelLinear  several column-parallel outputs in one weight (gate/up -> gate_up_proj)
    QKVParallelLinear           q/k/v in one weight; KV heads replicated when tp > num_kv_heads
    RowParallelLinear           columns split, then an all-reduce; rank 0 alone adds the bias
"""

from __future__ import annotations

import torch
from torch import nn

from roofline.distributed.communication import tensor_parallel_all_reduce
from roofline.distributed.parallel_state import divide, get_tp_rank, get_tp_size
from roofline.quant.base import QuantConfig, UnquantizedLinearMethod, set_weight_attrs


def _copy_checked(dest: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(dest.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint has {tuple(loaded.shape)}, this rank's parameter expects {tuple(dest.shape)}")
    if dest.dtype.is_floating_point != loaded.dtype.is_floating_point:
        # Packed integer codes (qweight, qzeros, g_idx) stored as floats, or the reverse, would be copied as values.
        raise ValueError(f"checkpoint has dtype {loaded.dtype}, the parameter holds {dest.dtype}")
    dest.copy_(loaded)


def _check_full_shape(loaded: torch.Tensor, shard_shape: torch.Size, dim: int, full_size: int) -> None:
    """The checkpoint tensor must be the whole (unsharded) tensor: ``shard_shape`` with ``dim`` = ``full_size``."""
    want = list(shard_shape)
    want[dim] = full_size
    if list(loaded.shape) != want:
        raise ValueError(f"checkpoint has {tuple(loaded.shape)}, the model expects {tuple(want)}")


def _packed(param: torch.Tensor, dim: int, start: int, size: int, prefix: str) -> tuple[int, int]:
    """A shard's (start, size) along ``dim`` in rows, divided by the pack factor when ``dim`` is packed
    (AWQ and GPTQ hold 8 INT4 values per int32 word along N: ``packed_dim`` / ``pack_factor`` attributes)."""
    factor = getattr(param, "pack_factor", 1)
    if getattr(param, "packed_dim", None) != dim or factor == 1:
        return start, size
    if start % factor or size % factor:
        raise ValueError(f"{prefix or 'layer'}: a shard of {size} rows at row {start} does not fall on the "
                         f"{factor}-row boundaries of the packed checkpoint tensor")
    return start // factor, size // factor


class LinearBase(nn.Module):
    """Common constructor: sizes on this rank, the quantization method, and an optional bias.

    Args:
        input_size, output_size: the full (unsharded) layer's sizes.
        prefix: the layer's Hugging Face name (``model.layers.0.self_attn.qkv_proj``); quantization
            configs choose per layer by it.
        quant_config: the weight format, or None for 16-bit weights.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, prefix: str,
                 quant_config: QuantConfig | None, params_dtype: torch.dtype | None):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.prefix = prefix
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.quant_method = (quant_config.get_linear_method(self, prefix) if quant_config is not None
                             else UnquantizedLinearMethod())
        self._has_bias = bias

    def _create(self, input_size_per_partition: int, output_partition_sizes: list[int],
                bias_rows: int | None) -> None:
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = output_partition_sizes
        self.quant_method.create_weights(self, input_size_per_partition, output_partition_sizes,
                                         self.params_dtype, self.weight_loader)
        if self._has_bias:
            rows = sum(output_partition_sizes) if bias_rows is None else bias_rows
            self.bias = nn.Parameter(torch.empty(rows, dtype=self.params_dtype), requires_grad=False)
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def input_quant(self, x: torch.Tensor) -> str | None:
        """The per-token format ("int8" / "fp8") in which this layer would quantize its input ``x`` [T, K] in a pass
        of its own (``LinearMethod.input_quant``): what the kernel producing x may fuse in (``RMSNorm.forward``'s and
        ``silu_and_mul``'s ``quant_for``, which then hand over a ``QuantizedActivation``); None otherwise."""
        return self.quant_method.input_quant(self, x.shape[0]) if x.dim() == 2 else None

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, tp={self.tp_rank}/{self.tp_size}, "
                f"method={type(self.quant_method).__name__}")


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, prefix: str = "",
                 quant_config: QuantConfig | None = None, params_dtype: torch.dtype | None = None):
        super().__init__(input_size, output_size, bias, prefix, quant_config, params_dtype)
        self._create(input_size, [output_size], None)

    def weight_loader(self, param, loaded, shard_id=None):
        _copy_checked(param.data, loaded)


class ColumnParallelLinear(LinearBase):
    """Output rows split across ranks; ``forward`` returns this rank's slice of the output."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, prefix: str = "",
                 quant_config: QuantConfig | None = None, params_dtype: torch.dtype | None = None,
                 output_sizes: list[int] | None = None):
        super().__init__(input_size, output_size, bias, prefix, quant_config, params_dtype)
        self.output_sizes = output_sizes or [output_size]
        parts = [divide(s, self.tp_size, f"{prefix or 'layer'} output size") for s in self.output_sizes]
        self._create(input_size, parts, None)

    def weight_loader(self, param, loaded, shard_id=None):
        dim = getattr(param, "output_dim", None)
        if dim is None:  # a per-tensor quantity (a scalar scale): every rank holds it whole
            _copy_checked(param.data, loaded)
            return
        size = param.shape[dim]
        _check_full_shape(loaded, param.shape, dim, size * self.tp_size)
        _copy_checked(param.data, loaded.narrow(dim, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one weight (gate and up of SwiGLU). Shard ``i`` of the checkpoint
    (``shard_id`` an int) fills rows ``[sum(sizes[:i]), sum(sizes[:i + 1])) / tp`` on this rank."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, prefix: str = "",
                 quant_config: QuantConfig | None = None, params_dtype: torch.dtype | None = None):
        super().__init__(input_size, sum(output_sizes), bias, prefix, quant_config, params_dtype,
                         output_sizes=list(output_sizes))

    def shard_range(self, shard_id: int) -> tuple[int, int]:
        """(first row, rows) of shard ``shard_id`` in this rank's weight."""
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be in [0, {len(self.output_sizes)}), got {shard_id!r}")
        sizes = self.output_partition_sizes
        return sum(sizes[:shard_id]), sizes[shard_id]

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:
            raise ValueError(f"{self.prefix}: a merged layer needs a shard id for each checkpoint tensor")
        dim = getattr(param, "output_dim", 0)
        start, size = _packed(param, dim, *self.shard_range(int(shard_id)), self.prefix)
        dest = param.data.narrow(dim, start, size)
        _check_full_shape(loaded, dest.shape, dim, size * self.tp_size)
        _copy_checked(param.data.narrow(dim, start, size), loaded.narrow(dim, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one weight: rows [q | k | v] of this rank's heads.

    Query heads are split across ranks. KV heads are split too while ``tp_size <= num_kv_heads``; beyond
    that each KV head is replicated on ``tp_size / num_kv_heads`` ranks (which must divide evenly).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, prefix: str = "", quant_config: QuantConfig | None = None,
                 params_dtype: torch.dtype | None = None):
        LinearBase.__init__(self, hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, prefix,
                            quant_config, params_dtype)
        tp = self.tp_size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, f"{prefix or 'qkv'} num_heads")
        if tp >= num_kv_heads:
            if tp % num_kv_heads:
                raise ValueError(f"{prefix or 'qkv'}: num_kv_heads {num_kv_heads} must divide the tensor-parallel "
                                 f"size {tp} to replicate KV heads")
            self.num_kv_heads = 1
            self.num_kv_replicas = tp // num_kv_heads
        else:
            self.num_kv_heads = divide(num_kv_heads, tp, f"{prefix or 'qkv'} num_kv_heads")
            self.num_kv_replicas = 1
        self.output_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self._create(hidden_size, [q, kv, kv], None)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"{self.prefix}: shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        dim = getattr(param, "output_dim", 0)
        q, kv = self.q_size, self.kv_size
        start, size = _packed(param, dim, *{"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id], self.prefix)
        # Which slice of the checkpoint tensor this rank holds: its own query heads, and the KV heads
        # of its replica group.
        src_rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.num_kv_replicas
        num_src = self.tp_size if shard_id == "q" else self.tp_size // self.num_kv_replicas
        _check_full_shape(loaded, param.data.narrow(dim, start, size).shape, dim, size * num_src)
        _copy_checked(param.data.narrow(dim, start, size), loaded.narrow(dim, src_rank * size, size))


class RowParallelLinear(LinearBase):
    """Input columns split across ranks (the input is already this rank's slice); partial products are
    all-reduced; the bias is added by rank 0 only, so the reduced sum counts it once."""

    input_is_parallel = True  # each rank holds K / tp input columns (quantization scales span the ranks)

    def __init__(self, input_size: int, output_size: int, bias: bool = False, prefix: str = "",
                 quant_config: QuantConfig | None = None, params_dtype: torch.dtype | None = None,
                 reduce_results: bool = True):
        super().__init__(input_size, output_size, bias, prefix, quant_config, params_dtype)
        self.reduce_results = reduce_results
        self._create(divide(input_size, self.tp_size, f"{prefix or 'layer'} input size"), [output_size],
                     output_size)

    def weight_loader(self, param, loaded, shard_id=None):
        dim = getattr(param, "input_dim", None)
        if dim is None:  # bias or a per-output-channel quantity: replicated
            _copy_checked(param.data, loaded)
            return
        size = param.shape[dim]
        _check_full_shape(loaded, param.shape, dim, size * self.tp_size)
        _copy_checked(param.data, loaded.narrow(dim, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Rank 0 alone adds the bias, so the (possibly deferred) sum over ranks counts it once.
        out = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_parallel_all_reduce(out)
        return out
