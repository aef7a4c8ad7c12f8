"""The bound model: how fast a decode step could possibly be.

A decode step cannot finish before ``max(memory_time, compute_time)``: it must stream every weight
and every KV entry it attends to from HBM, and it must do ``2 x parameters`` FLOPs per token
(Pope et al. 2022, "Efficiently Scaling Transformer Inference", sections 2-3). Speculative decoding
trades extra FLOPs for fewer weight reads; its expected gain follows Leviathan et al. 2023,
"Fast Inference from Transformers via Speculative Decoding", section 3.

Every time this module returns is a **lower bound** (seconds), not a latency: real steps add kernel
launch gaps, attention inefficiency and host work on top. Pure Python; no torch import.

Parallelism (:func:`parallel_step`, :func:`best_layouts`): tensor parallelism (TP) splits each layer
over a group of GPUs and sums partial outputs with two all-reduces per layer (Shoeybi et al. 2019,
"Megatron-LM"); pipeline parallelism (PP) splits the layers into stages that hand activations on. Per
GPU, the memory and compute terms are the bounds above; all-reduces and sends follow the ring
latency-bandwidth model (Thakur et al. 2005, "Optimization of Collective Communication Operations in
MPICH") on the slowest link of their group, a floor-side estimate rather than a strict bound; the
pipeline bubble follows GPipe (Huang et al. 2019).

Units: bytes, seconds, FLOP, FLOP/s, bytes/s. "GB" is 1e9 bytes, "GiB" is 2**30 bytes.

One module per part, all re-exported here (``from roofline.costmodel import X``):
- :mod:`~roofline.costmodel.formats`: bytes (weight formats, KV dtypes) and the engine's dtype names;
- :mod:`~roofline.costmodel.bound`: step lower bounds, the ridge point, what fits;
- :mod:`~roofline.costmodel.speculation`: Leviathan et al.'s expected tokens, speedup, break-even, best gamma;
- :mod:`~roofline.costmodel.report`: a measured decode step beside its floor;
- :mod:`~roofline.costmodel.shapes`: :class:`ModelShape` and the worksheet fixture;
- :mod:`~roofline.costmodel.links`: links between GPUs, all-reduce and send times, the interconnect presets;
- :mod:`~roofline.costmodel.parallel`: TP x PP shards, bounds and layouts.

The engine's bytes per step under a ``--quantization`` and the step predicted from kernels measured on the device
(:mod:`~roofline.costmodel.measured`, built by :mod:`~roofline.costmodel.measured_build`), the ``roofline cost``
artifact, its table and its plot (:mod:`~roofline.costmodel.artifact`,
:mod:`~roofline.costmodel.table`, :mod:`~roofline.costmodel.plot`) are imported on their own.
"""

from roofline.costmodel.bound import (
    DEFAULT_RESERVE_FRACTION,
    StepBound,
    compute_time,
    fits_on_device,
    hardware_ratio,
    memory_time,
    min_compute_bound_batch,
    step_bound,
)
from roofline.costmodel.common import (
    GB,
    GIB,
    PAPER_LEVIATHAN,
    PAPER_POPE,
)
from roofline.costmodel.formats import (
    DEFAULT_FORMATS,
    DTYPE_ALIASES,
    KV_DTYPE_BYTES,
    KV_SCALE_BYTES,
    QUANTIZATION_FORMATS,
    WEIGHT_FORMAT_BITS,
    WeightFormat,
    canonical_dtype,
    kv_bytes_per_sequence,
    kv_cache_bytes_per_token,
    kv_dtype_bytes,
    kv_scale_bytes,
    parse_weight_format,
    rate_unit,
    weight_bytes,
    weight_bytes_per_tensor,
)
from roofline.costmodel.links import (
    INTERCONNECT_PRESETS,
    PAPER_THAKUR,
    Link,
    group_link,
    load_interconnect,
    ring_allreduce_time,
    send_recv_time,
    slowest_link,
)
from roofline.costmodel.parallel import (
    ACTIVATION_BYTES,
    ALLREDUCES_PER_LAYER,
    PAPER_GPIPE,
    PAPER_MEGATRON,
    ParallelBound,
    StageBound,
    StageShard,
    allowed_tp_sizes,
    best_layouts,
    check_parallel_layout,
    kv_heads_per_gpu,
    parallel_step,
    pipeline_utilization,
    shard_stages,
    stage_layer_counts,
)
from roofline.costmodel.report import (
    decode_floor_report,
)
from roofline.costmodel.shapes import (
    DENSE_70B_FIXTURE,
    FIXTURE_SHAPES,
    WORKSHEET,
    ModelShape,
)
from roofline.costmodel.speculation import (
    MAX_GAMMA,
    average_tpot,
    best_gamma,
    break_even_alpha,
    expected_tokens_per_step,
    iteration_time,
    speculative_speedup,
    verify_cost_ratio,
)

__all__ = [
    "DEFAULT_RESERVE_FRACTION",
    "StepBound",
    "compute_time",
    "fits_on_device",
    "hardware_ratio",
    "memory_time",
    "min_compute_bound_batch",
    "step_bound",
    "GB",
    "GIB",
    "PAPER_LEVIATHAN",
    "PAPER_POPE",
    "DEFAULT_FORMATS",
    "DTYPE_ALIASES",
    "KV_DTYPE_BYTES",
    "KV_SCALE_BYTES",
    "QUANTIZATION_FORMATS",
    "WEIGHT_FORMAT_BITS",
    "WeightFormat",
    "canonical_dtype",
    "kv_bytes_per_sequence",
    "kv_cache_bytes_per_token",
    "kv_dtype_bytes",
    "kv_scale_bytes",
    "parse_weight_format",
    "rate_unit",
    "weight_bytes",
    "weight_bytes_per_tensor",
    "INTERCONNECT_PRESETS",
    "Link",
    "PAPER_THAKUR",
    "group_link",
    "load_interconnect",
    "ring_allreduce_time",
    "send_recv_time",
    "slowest_link",
    "ACTIVATION_BYTES",
    "ALLREDUCES_PER_LAYER",
    "PAPER_GPIPE",
    "PAPER_MEGATRON",
    "ParallelBound",
    "StageBound",
    "StageShard",
    "allowed_tp_sizes",
    "best_layouts",
    "check_parallel_layout",
    "kv_heads_per_gpu",
    "parallel_step",
    "pipeline_utilization",
    "shard_stages",
    "stage_layer_counts",
    "decode_floor_report",
    "DENSE_70B_FIXTURE",
    "FIXTURE_SHAPES",
    "ModelShape",
    "WORKSHEET",
    "MAX_GAMMA",
    "average_tpot",
    "best_gamma",
    "break_even_alpha",
    "expected_tokens_per_step",
    "iteration_time",
    "speculative_speedup",
    "verify_cost_ratio",
]
