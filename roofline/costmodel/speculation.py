"""Speculative decoding (Leviathan et al. 2023, section 3): expected tokens, speedup, break-even, best gamma."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from roofline.costmodel.bound import step_bound
from roofline.costmodel.common import _check_alpha, _check_gamma, _check_non_negative, _check_positive

MAX_GAMMA = 8


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """E[tokens per target step] = ``(1 - alpha^(gamma+1)) / (1 - alpha)`` (Leviathan et al. 2023, eq. 1).

    ``alpha`` is the per-token acceptance rate in [0, 1); ``gamma`` the number of draft tokens.
    """
    _check_alpha(alpha)
    _check_gamma(gamma)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def speculative_speedup(alpha: float, gamma: int, draft_cost: float, verify_cost_ratio: float = 1.0) -> float:
    """Walltime improvement ``E / (gamma c + verify_cost_ratio)`` (Leviathan et al. 2023, theorem 3.8).

    ``draft_cost`` c is one draft step's time over one plain target step. With free verification
    (``verify_cost_ratio`` 1, the paper's assumption) this is the paper's formula; at batch, the target
    pass over ``gamma + 1`` positions costs :func:`verify_cost_ratio` plain steps.
    """
    _check_non_negative("draft_cost", draft_cost)
    _check_positive("verify_cost_ratio", verify_cost_ratio)
    return expected_tokens_per_step(alpha, gamma) / (gamma * draft_cost + verify_cost_ratio)


def verify_cost_ratio(num_params: float, weight_bytes: float, kv_bytes_per_seq: float, batch: int,
                      bandwidth: float, peak_flops: float, gamma: int) -> float:
    """``step_bound(gamma + 1 positions) / step_bound(1 position)`` at ``batch``; 1.0 while memory-bound.

    Replaces the "+1" of Leviathan et al. 2023 when verification is not free (Pope et al. 2022 bounds).
    """
    _check_gamma(gamma)
    args = (num_params, weight_bytes, kv_bytes_per_seq, batch, bandwidth, peak_flops)
    return step_bound(*args, positions=gamma + 1).bound_s / step_bound(*args, positions=1).bound_s


def iteration_time(plain_step_s: float, gamma: int, draft_cost: float, verify_cost_ratio: float = 1.0) -> float:
    """Seconds per speculative iteration: ``plain_step x (gamma c + verify_cost_ratio)``.

    A lower bound when ``plain_step_s`` is one (Leviathan et al. 2023, section 3.4).
    """
    _check_positive("plain_step_s", plain_step_s)
    _check_gamma(gamma)
    _check_non_negative("draft_cost", draft_cost)
    return plain_step_s * (gamma * draft_cost + verify_cost_ratio)


def average_tpot(plain_step_s: float, alpha: float, gamma: int, draft_cost: float,
                 verify_cost_ratio: float = 1.0) -> float:
    """Average time per output token (s): iteration time / E[tokens per step]."""
    return (iteration_time(plain_step_s, gamma, draft_cost, verify_cost_ratio)
            / expected_tokens_per_step(alpha, gamma))


def break_even_alpha(gamma: int, draft_cost: float, verify_cost_ratio: float = 1.0) -> float | None:
    """Smallest acceptance rate at which speculation is no slower than plain decoding.

    Solves ``E(alpha) = gamma c + verify_cost_ratio`` by bisection (E rises from 1 at alpha 0 towards
    ``gamma + 1``). Returns 0.0 when speculation never loses, ``None`` when it never wins.
    """
    _check_gamma(gamma)
    _check_non_negative("draft_cost", draft_cost)
    cost = gamma * draft_cost + verify_cost_ratio
    if cost <= 1.0:
        return 0.0
    if cost >= gamma + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if expected_tokens_per_step(mid, gamma) < cost:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-15:
            break
    return hi


def best_gamma(alpha: float, draft_cost: float,
               verify_cost_ratio: float | Callable[[int], float] = 1.0,
               gammas: Iterable[int] = range(1, MAX_GAMMA + 1)) -> tuple[int, float]:
    """The ``gamma`` in 1..8 that maximizes :func:`speculative_speedup`; returns ``(gamma, speedup)``.

    ``verify_cost_ratio`` may be a function of gamma (at batch it grows with gamma).
    """
    best: tuple[int, float] | None = None
    for g in gammas:
        ratio = verify_cost_ratio(g) if callable(verify_cost_ratio) else verify_cost_ratio
        s = speculative_speedup(alpha, g, draft_cost, ratio)
        if best is None or s > best[1]:
            best = (g, s)
    if best is None:
        raise ValueError("gammas must not be empty")
    return best
