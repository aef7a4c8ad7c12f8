"""Time lower bounds of one step (Pope et al. 2022, sections 2-3): bytes over bandwidth, FLOPs over peak."""

from __future__ import annotations

import math
from dataclasses import dataclass

from roofline.costmodel.common import _check_non_negative, _check_positive

DEFAULT_RESERVE_FRACTION = 0.10  # of device memory, for activations, CUDA context and fragmentation


def memory_time(weight_bytes: float, kv_bytes_per_seq: float, batch: int, bandwidth: float) -> float:
    """Lower bound (s) from bytes: ``(weights + batch x KV per sequence) / bandwidth`` (Pope et al. 2022).

    Every step reads all weights once and each sequence's KV once, whatever the number of positions.
    """
    _check_non_negative("weight_bytes", weight_bytes)
    _check_non_negative("kv_bytes_per_seq", kv_bytes_per_seq)
    _check_non_negative("batch", batch)
    _check_positive("bandwidth", bandwidth)
    return (weight_bytes + batch * kv_bytes_per_seq) / bandwidth


def compute_time(num_params: float, batch: int, positions: int, peak_flops: float) -> float:
    """Lower bound (s) from FLOPs: ``2 x parameters x batch x positions / peak`` (Pope et al. 2022, 3.1).

    ``positions`` is tokens per sequence in the step: 1 for plain decoding, ``gamma + 1`` when verifying.
    Attention FLOPs are left out (small next to the matmuls at these contexts), so this stays a bound.
    """
    _check_non_negative("num_params", num_params)
    _check_non_negative("batch", batch)
    _check_positive("positions", positions)
    _check_positive("peak_flops", peak_flops)
    return 2 * num_params * batch * positions / peak_flops


@dataclass(frozen=True)
class StepBound:
    """Lower bound of one forward step. Times in seconds, intensity in FLOP/byte."""

    memory_s: float
    compute_s: float
    flops: float
    bytes_moved: float
    hardware_ratio: float  # peak FLOP/s / bandwidth bytes/s

    @property
    def bound_s(self) -> float:
        """The step lower bound: ``max(memory_s, compute_s)``."""
        return max(self.memory_s, self.compute_s)

    @property
    def bound_by(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "memory"

    @property
    def arithmetic_intensity(self) -> float:
        """FLOP per byte moved; compute-bound when above :attr:`hardware_ratio` (Pope et al. 2022)."""
        return self.flops / self.bytes_moved if self.bytes_moved else math.inf

    def as_dict(self) -> dict[str, float | str]:
        return {"memory_lower_bound_s": self.memory_s, "compute_lower_bound_s": self.compute_s,
                "step_lower_bound_s": self.bound_s, "bound_by": self.bound_by, "flops": self.flops,
                "bytes_moved": self.bytes_moved, "arithmetic_intensity": self.arithmetic_intensity,
                "hardware_ratio": self.hardware_ratio}


def step_bound(num_params: float, weight_bytes: float, kv_bytes_per_seq: float, batch: int,
               bandwidth: float, peak_flops: float, positions: int = 1) -> StepBound:
    """``max(memory_time, compute_time)`` for a step of ``batch`` sequences x ``positions`` tokens."""
    mem = memory_time(weight_bytes, kv_bytes_per_seq, batch, bandwidth)
    comp = compute_time(num_params, batch, positions, peak_flops)
    return StepBound(memory_s=mem, compute_s=comp, flops=2 * num_params * batch * positions,
                     bytes_moved=weight_bytes + batch * kv_bytes_per_seq,
                     hardware_ratio=peak_flops / bandwidth)


def hardware_ratio(peak_flops: float, bandwidth: float) -> float:
    """FLOP/byte at which a kernel turns compute-bound (the roofline ridge point)."""
    _check_positive("peak_flops", peak_flops)
    _check_positive("bandwidth", bandwidth)
    return peak_flops / bandwidth


def min_compute_bound_batch(num_params: float, weight_bytes: float, kv_bytes_per_seq: float,
                            bandwidth: float, peak_flops: float, positions: int = 1,
                            max_batch: int = 1 << 20) -> int | None:
    """Smallest batch with ``compute_time >= memory_time`` for ``positions`` tokens per sequence.

    Solves ``b (2 P positions / peak - KV / bandwidth) >= weights / bandwidth``. Returns ``None`` when
    KV reads grow faster with batch than FLOPs do (never compute-bound), or past ``max_batch``.
    """
    per_seq = 2 * num_params * positions / peak_flops - kv_bytes_per_seq / bandwidth
    if per_seq <= 0:
        return None
    b = max(1, math.ceil(weight_bytes / bandwidth / per_seq) - 1)

    def is_compute_bound(n: int) -> bool:
        return (compute_time(num_params, n, positions, peak_flops)
                >= memory_time(weight_bytes, kv_bytes_per_seq, n, bandwidth))

    while not is_compute_bound(b):  # guard the closed form against rounding
        b += 1
    while b > 1 and is_compute_bound(b - 1):
        b -= 1
    return b if b <= max_batch else None


def fits_on_device(weight_bytes: float, kv_bytes_per_seq: float, batch: int, capacity_bytes: float,
                   reserve_bytes: float | None = None) -> dict[str, float | bool]:
    """Whether weights + ``batch`` sequences of KV + a reserve fit in device memory.

    The reserve (activations, CUDA context, allocator fragmentation) defaults to
    ``DEFAULT_RESERVE_FRACTION`` (10%) of capacity. Returns the bytes needed, the capacity, the
    reserve, ``fits`` and ``max_batch`` (largest batch that fits; 0 if weights alone do not).
    """
    _check_positive("capacity_bytes", capacity_bytes)
    reserve = DEFAULT_RESERVE_FRACTION * capacity_bytes if reserve_bytes is None else reserve_bytes
    _check_non_negative("reserve_bytes", reserve)
    needed = weight_bytes + batch * kv_bytes_per_seq + reserve
    free_for_kv = capacity_bytes - reserve - weight_bytes
    if free_for_kv < 0:
        max_batch = 0
    elif kv_bytes_per_seq == 0:
        max_batch = -1  # unlimited by memory
    else:
        max_batch = int(free_for_kv // kv_bytes_per_seq)
    return {"fits": needed <= capacity_bytes, "needed_bytes": needed, "capacity_bytes": capacity_bytes,
            "reserve_bytes": reserve, "max_batch": max_batch}
