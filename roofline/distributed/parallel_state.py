"""Which tensor-parallel rank this process is, and how many there are.

Layers read the state when they are built (their shapes depend on it), so it must be set before the model
is constructed. A tensor-parallel worker process sets it once (``set_tensor_parallel_state``), after
``torch.distributed`` is initialized (``roofline.worker.multiproc_executor``); tests also simulate other ranks
with ``tensor_parallel_state(rank, size)`` to check how weights are sharded, without any communication.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank}")


_STATE = ParallelState()


def get_tp_rank() -> int:
    return _STATE.tp_rank


def get_tp_size() -> int:
    return _STATE.tp_size


def set_tensor_parallel_state(rank: int, size: int) -> None:
    """This process is rank ``rank`` of ``size`` from now on (a worker process, before it builds the model)."""
    global _STATE
    _STATE = ParallelState(rank, size)


@contextlib.contextmanager
def tensor_parallel_state(rank: int, size: int) -> Iterator[ParallelState]:
    """Build layers as rank ``rank`` of ``size`` inside the block (restores the previous state after)."""
    global _STATE
    prev, _STATE = _STATE, ParallelState(rank, size)
    try:
        yield _STATE
    finally:
        _STATE = prev


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """``numerator / denominator``, which must be exact.

    Raises:
        ValueError: ``numerator`` is not a multiple of ``denominator`` (names ``what`` and both values).
    """
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator
