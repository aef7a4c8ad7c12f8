"""Which tensor-parallel rank and pipeline stage this process is, and how many there are.

Layers read the state when they are built (their shapes, and which layers exist, depend on it), so it must be
set before the model is constructed. A worker process sets it once (``set_parallel_state``), after
``torch.distributed`` is initialized (``roofline.worker.multiproc_executor``); tests also simulate other ranks
with ``tensor_parallel_state(rank, size)`` to check how weights are sharded, without any communication.

The layout is vLLM's: global rank = pp_rank * tp_size + tp_rank, so the tp_size ranks of one pipeline stage
are consecutive (one node's GPUs when TP stays inside a node and PP crosses nodes). A stage's tensor-parallel
collectives run in that stage's group (``tp_group``; None means the whole world, at pipeline size 1), and a
stage sends its activations to the same tp_rank of the next stage (``pp_next_rank``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from roofline.parallel_config import stage_layer_ranges  # noqa: F401 - pure Python, kept importable from here


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None  # torch.distributed group of this stage's ranks (None: the default group)
    layer_range: tuple[int, int] | None = None  # this stage's decoder layers [start, end) (None: all)
    enable_expert_parallel: bool = False  # MoE layers: experts split over the tp group (roofline.layers.moe)

    def __post_init__(self) -> None:
        for name, rank, size in (("tp", self.tp_rank, self.tp_size), ("pp", self.pp_rank, self.pp_size)):
            if size < 1:
                raise ValueError(f"{name}_size must be >= 1, got {size}")
            if not 0 <= rank < size:
                raise ValueError(f"{name}_rank must be in [0, {size}), got {rank}")

    @property
    def rank(self) -> int:
        """This process's global rank (pp_rank * tp_size + tp_rank)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def pp_prev_rank(self) -> int:
        return self.rank - self.tp_size

    @property
    def pp_next_rank(self) -> int:
        return self.rank + self.tp_size

    @property
    def last_stage_rank(self) -> int:
        """The global rank of the last stage's tp_rank 0, which samples and whose output every rank takes."""
        return (self.pp_size - 1) * self.tp_size


_STATE = ParallelState()


def get_tp_rank() -> int:
    return _STATE.tp_rank


def get_tp_size() -> int:
    return _STATE.tp_size


def get_parallel_state() -> ParallelState:
    return _STATE


def get_tp_group() -> Any:
    return _STATE.tp_group


def set_parallel_state(state: ParallelState) -> None:
    """This process's place in the layout from now on (a worker process, before it builds the model)."""
    global _STATE
    _STATE = state


def set_tensor_parallel_state(rank: int, size: int) -> None:
    """This process is tensor-parallel rank ``rank`` of ``size`` (one pipeline stage) from now on."""
    set_parallel_state(ParallelState(rank, size))


@contextlib.contextmanager
def parallel_state(state: ParallelState) -> Iterator[ParallelState]:
    """Build layers as ``state``'s rank inside the block (restores the previous state after)."""
    global _STATE
    prev, _STATE = _STATE, state
    try:
        yield _STATE
    finally:
        _STATE = prev


def tensor_parallel_state(rank: int, size: int) -> contextlib.AbstractContextManager[ParallelState]:
    """Build layers as tensor-parallel rank ``rank`` of ``size`` inside the block."""
    return parallel_state(ParallelState(rank, size))




def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """``numerator / denominator``, which must be exact.

    Raises:
        ValueError: ``numerator`` is not a multiple of ``denominator`` (names ``what`` and both values).
    """
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator
