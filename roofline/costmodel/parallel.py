"""Parallelism: tensor parallel (TP) within a pipeline stage, pipeline parallel (PP) across stages.

Placement: global rank r = stage x tp + tp_rank sits on node r // gpus_per_node (TP innermost, as
Megatron-LM and vLLM place it, so a TP group stays inside a node whenever it can).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from roofline.costmodel.bound import compute_time, fits_on_device, memory_time
from roofline.costmodel.common import _check_count, _check_positive
from roofline.costmodel.formats import (
    WeightFormat,
    kv_bytes_per_sequence,
    kv_dtype_bytes,
    kv_scale_bytes,
    parse_weight_format,
)
from roofline.costmodel.links import Link, group_link, ring_allreduce_time, send_recv_time, slowest_link
from roofline.costmodel.shapes import ModelShape

PAPER_MEGATRON = ('Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using '
                  'Model Parallelism" (arXiv:1909.08053)')
PAPER_GPIPE = ('Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline '
               'Parallelism" (NeurIPS 2019, arXiv:1811.06965)')
ACTIVATION_BYTES = 2.0  # bf16: bytes per element of what a TP all-reduce or a PP send carries
ALLREDUCES_PER_LAYER = 2  # after attention's o_proj and after the MLP's down_proj (Megatron-LM, section 3)


def pipeline_utilization(num_micro_batches: int, num_stages: int) -> float:
    """Busy fraction of a flushed pipeline: ``m / (m + p - 1)`` for m micro-batches over p stages
    (GPipe, Huang et al. 2019, section 2: bubble ``(p - 1) / (m + p - 1)``). E.g. m 4, p 2: 0.8."""
    _check_count("num_micro_batches", num_micro_batches)
    _check_count("num_stages", num_stages)
    return num_micro_batches / (num_micro_batches + num_stages - 1)


def allowed_tp_sizes(num_attention_heads: int, num_kv_heads: int) -> list[int]:
    """TP sizes that shard attention cleanly: divisors of the attention heads that divide the KV heads
    or are multiples of them (then each KV head is replicated, as vLLM does). E.g. 32 heads, 8 KV heads:
    1, 2, 4, 8, 16, 32."""
    return [t for t in range(1, num_attention_heads + 1)
            if num_attention_heads % t == 0 and (num_kv_heads % t == 0 or t % num_kv_heads == 0)]


def check_parallel_layout(shape: ModelShape, tp: int, pp: int, tp_name: str = "tp", pp_name: str = "pp") -> None:
    """Raise ``ValueError`` unless ``tp`` is in :func:`allowed_tp_sizes` and ``pp`` in [1, layers].

    The message names the value, the model's heads or layers and the allowed values, using ``tp_name``
    and ``pp_name`` for the two (the CLI passes ``--tp`` and ``--pp``).
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"{tp_name} must be an integer >= 1, got {tp!r}")
    allowed = allowed_tp_sizes(shape.num_attention_heads, shape.num_kv_heads)
    if tp not in allowed:
        why = (f"does not divide the {shape.num_attention_heads} attention heads"
               if shape.num_attention_heads % tp else
               f"neither divides nor is a multiple of the {shape.num_kv_heads} KV heads")
        raise ValueError(f"{tp_name} {tp} {why} of {shape.name}; allowed {tp_name}: "
                         f"{', '.join(map(str, allowed))}")
    if isinstance(pp, bool) or not isinstance(pp, int) or not 1 <= pp <= shape.num_layers:
        raise ValueError(f"{pp_name} must be an integer in [1, {shape.num_layers}] (the layers of {shape.name}), "
                         f"got {pp!r}")


def kv_heads_per_gpu(num_kv_heads: int, tp: int) -> int:
    """KV heads each GPU of a TP group stores: ``max(1, num_kv_heads / tp)``; past ``tp = num_kv_heads``
    every GPU keeps one head, replicated ``tp / num_kv_heads`` times across the group."""
    _check_positive("num_kv_heads", num_kv_heads)
    _check_positive("tp", tp)
    return max(1, num_kv_heads // tp)


def stage_layer_counts(num_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage: ``num_layers // pp`` each, the remainder one apiece to the first stages."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pp must be in [1, {num_layers}] (the number of layers), got {pp!r}")
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


@dataclass(frozen=True)
class StageShard:
    """What each GPU of one pipeline stage holds; all GPUs of a TP group hold the same amount.

    ``params`` and ``weight_bytes`` are per GPU; ``kv_bytes_per_seq`` is per GPU per sequence at the
    context it was computed for, ``kv_heads`` per GPU per layer.
    """

    stage: int
    num_layers: int
    params: float
    weight_bytes: float
    kv_heads: int
    kv_bytes_per_seq: float


def shard_stages(shape: ModelShape, tp: int, pp: int, fmt: str | float | WeightFormat = "bf16",
                 context: int = 0, kv_dtype: str = "bf16") -> list[StageShard]:
    """Per-GPU weights and KV of each of the ``pp`` stages under TP ``tp``.

    Stage s holds its layers' parameters / tp (Megatron-LM, section 3: column- then row-parallel
    matmuls), plus the vocab-parallel embedding / tp on the first stage and the LM head / tp on the
    last (a tied embedding is kept a second time on the last stage when ``pp > 1``). The RMSNorm
    weights, which TP replicates, are divided too (under 1e-4 of a layer). KV: each layer of the stage
    keeps :func:`kv_heads_per_gpu` heads per GPU.

    Raises:
        ValueError: the layout does not fit the model (see :func:`check_parallel_layout`).
    """
    check_parallel_layout(shape, tp, pp)
    bits = parse_weight_format(fmt).bits_per_weight
    heads = kv_heads_per_gpu(shape.num_kv_heads, tp)
    shards = []
    for s, n in enumerate(stage_layer_counts(shape.num_layers, pp)):
        params = n * shape.layer_params
        if s == 0:
            params += shape.embedding_params
        if s == pp - 1:
            params += shape.embedding_params if (pp > 1 and shape.tie_word_embeddings) else shape.lm_head_params
        params /= tp
        kv = kv_bytes_per_sequence(n, heads, shape.head_dim, context, kv_dtype_bytes(kv_dtype),
                                   kv_scale_bytes(kv_dtype))
        shards.append(StageShard(stage=s, num_layers=n, params=params, weight_bytes=params * bits / 8,
                                 kv_heads=heads, kv_bytes_per_seq=kv))
    return shards


@dataclass(frozen=True)
class StageBound:
    """One stage of a decode step on each of its GPUs, at ``micro_batch`` sequences. Seconds.

    ``memory_s`` and ``compute_s`` are lower bounds (Pope et al. 2022); ``allreduce_s`` is one ring
    all-reduce (:func:`ring_allreduce_time`) over ``link``, done ``num_allreduces`` times.
    """

    shard: StageShard
    micro_batch: int
    link: Link
    memory_s: float
    compute_s: float
    allreduce_s: float
    num_allreduces: int

    @property
    def comm_s(self) -> float:
        return self.num_allreduces * self.allreduce_s

    @property
    def stage_s(self) -> float:
        """``max(memory_s, compute_s) + comm_s``: a layer's all-reduce cannot overlap the matmul whose
        output it sums, and the next layer waits for it."""
        return max(self.memory_s, self.compute_s) + self.comm_s

    def as_dict(self) -> dict[str, Any]:
        return {"stage": self.shard.stage, "num_layers": self.shard.num_layers,
                "params_per_gpu": self.shard.params, "weight_bytes_per_gpu": self.shard.weight_bytes,
                "kv_heads_per_gpu": self.shard.kv_heads, "kv_bytes_per_sequence_per_gpu": self.shard.kv_bytes_per_seq,
                "micro_batch": self.micro_batch, "tp_link": self.link.name,
                "memory_lower_bound_s": self.memory_s, "compute_lower_bound_s": self.compute_s,
                "allreduce_s": self.allreduce_s, "num_allreduces": self.num_allreduces,
                "allreduce_total_s": self.comm_s, "stage_s": self.stage_s}


@dataclass(frozen=True)
class ParallelBound:
    """A decode step of ``batch`` sequences under TP ``tp`` x PP ``pp``, in ``num_micro_batches``
    micro-batches of ``ceil(batch / m)``. Seconds; ``fits`` as :func:`fits_on_device` (worst stage),
    ``None`` when the capacity is unknown.

    ``send_s[i]`` is one micro-batch's (hidden, residual) send from stage i to i + 1 over
    ``send_links[i]``.
    """

    tp: int
    pp: int
    batch: int
    num_micro_batches: int
    stages: tuple[StageBound, ...]
    send_s: tuple[float, ...]
    send_links: tuple[Link, ...]
    fits: dict[str, Any] | None

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp

    @property
    def step_s(self) -> float:
        """``sum(stage_s) + (m - 1) max(stage_s) + sum(send_s)``: the last micro-batch enters after the
        slowest stage has taken the other m - 1, then crosses every stage and boundary (GPipe, a
        flushed pipeline). For uniform stages, ``(m + p - 1) stage + sends``; at m 1 the token time."""
        times = [s.stage_s for s in self.stages]
        return sum(times) + (self.num_micro_batches - 1) * max(times) + sum(self.send_s)

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s

    @property
    def utilization(self) -> float:
        return pipeline_utilization(self.num_micro_batches, self.pp)

    @property
    def comm_s(self) -> float:
        """Seconds of the step spent in all-reduces and sends, on the last micro-batch's path."""
        return sum(s.comm_s for s in self.stages) + sum(self.send_s)

    def as_dict(self) -> dict[str, Any]:
        return {"tp": self.tp, "pp": self.pp, "num_gpus": self.num_gpus, "batch": self.batch,
                "num_micro_batches": self.num_micro_batches, "step_s": self.step_s,
                "tokens_per_s": self.tokens_per_s, "pipeline_utilization": self.utilization,
                "communication_s": self.comm_s, "send_s": list(self.send_s),
                "send_links": [x.name for x in self.send_links], "fits": self.fits,
                "stages": [s.as_dict() for s in self.stages]}


def parallel_step(shape: ModelShape, tp: int, pp: int, batch: int, bandwidth: float, peak_flops: float,
                  intra: Link, inter: Link | None = None, gpus_per_node: int = 8,
                  fmt: str | float | WeightFormat = "bf16", context: int = 0, kv_dtype: str = "bf16",
                  num_micro_batches: int = 1, capacity_bytes: float | None = None,
                  activation_bytes: float = ACTIVATION_BYTES) -> ParallelBound:
    """The decode step of ``batch`` sequences on ``tp x pp`` GPUs (``bandwidth`` bytes/s and
    ``peak_flops`` FLOP/s each).

    Per stage and GPU, at micro-batch ``b = ceil(batch / m)``:
    ``max((weights + b x KV) / bandwidth, 2 x params x b / peak) + 2 x layers x all-reduce``, the
    all-reduce over ``b x hidden x activation_bytes`` bytes on the TP group's link (``intra``, or the
    slowest of ``intra`` and ``inter`` when the group spans nodes of ``gpus_per_node``). Between stages,
    ``2 x b x hidden x activation_bytes`` (hidden state and residual) by :func:`send_recv_time`.
    ``inter`` defaults to ``intra``. The embedding's all-reduce and the logits gather are left out (one
    message per step, against ``2 x layers``).

    Raises:
        ValueError: a bad layout (:func:`check_parallel_layout`), ``num_micro_batches`` outside
            [1, batch], or a non-positive size.
    """
    _check_count("batch", batch)
    if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int) \
            or not 1 <= num_micro_batches <= batch:
        raise ValueError(f"num_micro_batches must be an integer in [1, batch {batch}], got {num_micro_batches!r}")
    _check_count("gpus_per_node", gpus_per_node)
    _check_positive("activation_bytes", activation_bytes)
    inter = intra if inter is None else inter
    micro = math.ceil(batch / num_micro_batches)
    shards = shard_stages(shape, tp, pp, fmt, context, kv_dtype)
    message = micro * shape.hidden_size * activation_bytes  # one [micro, hidden] activation
    stages = []
    for sh in shards:
        link = group_link(range(sh.stage * tp, (sh.stage + 1) * tp), gpus_per_node, intra, inter)
        stages.append(StageBound(
            shard=sh, micro_batch=micro, link=link,
            memory_s=memory_time(sh.weight_bytes, sh.kv_bytes_per_seq, micro, bandwidth),
            compute_s=compute_time(sh.params, micro, 1, peak_flops),
            allreduce_s=ring_allreduce_time(message, tp, link.bandwidth, link.latency_s),
            num_allreduces=ALLREDUCES_PER_LAYER * sh.num_layers if tp > 1 else 0))
    # TP rank i of stage s sends to TP rank i of stage s + 1; the tp sends run side by side.
    send_links = tuple(slowest_link(*(group_link((s * tp + i, (s + 1) * tp + i), gpus_per_node, intra, inter)
                                      for i in range(tp))) for s in range(pp - 1))
    sends = tuple(send_recv_time(2 * message, x.bandwidth, x.latency_s) for x in send_links)
    fits = None
    if capacity_bytes is not None:
        per_stage = [fits_on_device(sh.weight_bytes, sh.kv_bytes_per_seq, batch, capacity_bytes) for sh in shards]
        batches = [f["max_batch"] for f in per_stage if f["max_batch"] >= 0]
        fits = {"fits": all(f["fits"] for f in per_stage),
                "needed_bytes": max(f["needed_bytes"] for f in per_stage),
                "capacity_bytes": capacity_bytes, "reserve_bytes": per_stage[0]["reserve_bytes"],
                "max_batch": min(batches) if batches else -1}
    return ParallelBound(tp=tp, pp=pp, batch=batch, num_micro_batches=num_micro_batches, stages=tuple(stages),
                         send_s=sends, send_links=send_links, fits=fits)


def best_layouts(shape: ModelShape, num_gpus: int, batch: int, bandwidth: float, peak_flops: float,
                 intra: Link, inter: Link | None = None, gpus_per_node: int = 8,
                 fmt: str | float | WeightFormat = "bf16", context: int = 0, kv_dtype: str = "bf16",
                 num_micro_batches: int = 1, capacity_bytes: float | None = None
                 ) -> list[tuple[ParallelBound, ParallelBound]]:
    """Every TP x PP layout on at most ``num_gpus`` GPUs, ranked: ``(batch-1 token, step at batch)``
    pairs of :func:`parallel_step`, those that fit at ``batch`` first, then by batch-1 token time
    (fewer GPUs first on a tie).

    TP runs over :func:`allowed_tp_sizes`, PP over 1..layers, with ``tp x pp <= num_gpus``.
    ``num_micro_batches`` is capped at ``batch``.
    """
    _check_count("num_gpus", num_gpus)
    common: dict[str, Any] = dict(bandwidth=bandwidth, peak_flops=peak_flops, intra=intra, inter=inter,
                                  gpus_per_node=gpus_per_node, fmt=fmt, context=context, kv_dtype=kv_dtype,
                                  capacity_bytes=capacity_bytes)
    out = []
    for tp in allowed_tp_sizes(shape.num_attention_heads, shape.num_kv_heads):
        for pp in range(1, min(shape.num_layers, num_gpus // tp) + 1):
            token = parallel_step(shape, tp, pp, 1, **common)
            at_batch = parallel_step(shape, tp, pp, batch, num_micro_batches=min(num_micro_batches, batch), **common)
            out.append((token, at_batch))
    out.sort(key=lambda r: (r[1].fits is not None and not r[1].fits["fits"], r[0].step_s, r[0].num_gpus))
    return out
