"""The parallel layout (:class:`ParallelConfig`): tensor-parallel ranks within a stage, pipeline stages, the
executor backend, and each stage's decoder layers (:func:`stage_layer_ranges`). Pure Python, below
``roofline.distributed``, which re-exports :func:`stage_layer_ranges`. ``roofline.config`` re-exports both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from roofline.model_config import ModelConfig


def stage_layer_ranges(num_layers: int, pp_size: int, partition: list[int] | None = None) -> list[tuple[int, int]]:
    """Each pipeline stage's decoder layers ``[start, end)``.

    Even by default: ``num_layers // pp_size`` each, the remainder going one by one to the first stages (the
    last stage also runs the final norm and the LM head). ``partition`` overrides it with each stage's layer
    count (vLLM's ``VLLM_PP_LAYER_PARTITION``; our ``--pipeline-layer-partition``).

    Raises:
        ValueError: more stages than layers, or a partition whose length is not ``pp_size``, with a count
            below 1, or whose sum is not ``num_layers`` (names the values).
    """
    if partition is None:
        if pp_size > num_layers:
            raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's {num_layers} layers "
                             f"(allowed: 1 to {num_layers})")
        base, extra = divmod(num_layers, pp_size)
        partition = [base + (i < extra) for i in range(pp_size)]
    elif len(partition) != pp_size:
        raise ValueError(f"pipeline layer partition {partition} has {len(partition)} stages' counts, but "
                         f"pipeline_parallel_size is {pp_size}: give one count per stage")
    elif min(partition) < 1 or sum(partition) != num_layers:
        raise ValueError(f"pipeline layer partition {partition} must give each of the {pp_size} stages >= 1 "
                         f"layer and sum to the model's {num_layers} layers (it sums to {sum(partition)})")
    starts = [sum(partition[:i]) for i in range(pp_size)]
    return [(a, a + n) for a, n in zip(starts, partition, strict=True)]


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout: ``pipeline_parallel_size`` stages, each of ``tensor_parallel_size`` worker processes
    (one per GPU, or a CPU process with gloo). Within a stage every sharded layer holds 1/N of its weight
    (``roofline.layers.linear``); the stages hold consecutive decoder layers (even by default, or
    ``pipeline_layer_partition``: each stage's layer count) and pass (hidden, residual) with send/recv.

    Raises:
        ValueError: a size below 1, an unknown backend, or ``uni`` with more than one process (names the value).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "mp": worker processes (any size; at size 1 it measures the executor's overhead); "uni": the worker in
    # the engine's process (size 1 only); "external_launcher": every process of a torchrun job runs the
    # engine and one rank's worker (multi-node; docs/distributed.md); None: "mp" above size 1, else "uni".
    distributed_executor_backend: str | None = None
    pipeline_layer_partition: tuple[int, ...] | None = None
    # MoE: the tensor-parallel ranks of a stage split the experts (E / tp whole experts each) instead of
    # each expert's width (vLLM's --enable-expert-parallel); attention and dense layers stay tensor-parallel.
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.distributed_executor_backend not in (None, "uni", "mp", "external_launcher"):
            raise ValueError(f"distributed_executor_backend must be 'uni', 'mp' or 'external_launcher', got "
                             f"{self.distributed_executor_backend!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one worker; tensor_parallel_size "
                             f"{self.tensor_parallel_size} x pipeline_parallel_size {self.pipeline_parallel_size} "
                             f"needs 'mp' or 'external_launcher'")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def uses_worker_processes(self) -> bool:
        return self.distributed_executor_backend == "mp" or (
            self.world_size > 1 and self.distributed_executor_backend != "external_launcher")

    @staticmethod
    def _shard_problem(model: ModelConfig, tp: int) -> str | None:
        """Why ``tp`` ranks cannot shard ``model`` (None: they can). Attention heads and the MLP width are
        split evenly; KV heads are split, or replicated when ``tp`` exceeds them; the vocabulary is padded."""
        if model.num_attention_heads % tp:
            return f"does not divide the {model.num_attention_heads} attention heads"
        dense_layers = model.num_hidden_layers - model.num_moe_layers
        if model.intermediate_size % tp and dense_layers:
            return f"does not divide the MLP width {model.intermediate_size} (intermediate_size)"
        if model.shared_expert_intermediate_size % tp:
            return f"does not divide the shared expert's width {model.shared_expert_intermediate_size}"
        kv = model.num_key_value_heads
        if kv % tp and tp % kv:
            return f"and the {kv} KV heads must divide one another"
        return None

    def check_model(self, model: ModelConfig) -> None:
        """The layout must shard ``model`` (``_shard_problem``).

        Raises:
            ValueError: naming the size, the dimension it does not divide and the sizes that work.
        """
        stage_layer_ranges(model.num_hidden_layers, self.pipeline_parallel_size,
                           list(self.pipeline_layer_partition) if self.pipeline_layer_partition else None)
        tp = self.tensor_parallel_size
        if self.enable_expert_parallel and not model.is_moe:
            logging.getLogger(__name__).warning(
                "enable_expert_parallel has no effect: %s is a dense model (no experts); its layers stay "
                "tensor-parallel over %d rank(s)", model.name, tp)
        if model.is_moe and self.enable_expert_parallel and model.num_experts % tp:
            sizes = [d for d in range(1, model.num_experts + 1) if model.num_experts % d == 0
                     and self._shard_problem(model, d) is None]
            raise ValueError(f"expert parallel size {tp} (tensor_parallel_size with enable_expert_parallel) does "
                             f"not divide the {model.num_experts} experts of {model.name}; sizes that do: "
                             + ", ".join(map(str, sizes)))
        if model.is_moe and not self.enable_expert_parallel and model.moe_intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide the experts' width "
                             f"{model.moe_intermediate_size} (moe_intermediate_size) of {model.name}; use "
                             f"enable_expert_parallel or one of: "
                             + ", ".join(str(d) for d in range(1, model.num_attention_heads + 1)
                                         if model.moe_intermediate_size % d == 0
                                         and self._shard_problem(model, d) is None))
        problem = self._shard_problem(model, tp)
        if problem is not None:
            allowed = [d for d in range(1, model.num_attention_heads + 1) if self._shard_problem(model, d) is None]
            raise ValueError(f"tensor_parallel_size {tp} {problem} of {model.name}; allowed: "
                             + ", ".join(map(str, allowed)))
