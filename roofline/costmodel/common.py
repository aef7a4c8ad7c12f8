"""Units, paper citations and the argument checks every part of the bound model shares."""

from __future__ import annotations

import math

GB = 1e9
GIB = float(2**30)

PAPER_POPE = 'Pope et al. 2022, "Efficiently Scaling Transformer Inference" (arXiv:2211.05102)'
PAPER_LEVIATHAN = ('Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding" '
                   "(ICML 2023, arXiv:2211.17192)")


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _check_non_negative(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _check_count(name: str, value: int, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_alpha(alpha: float) -> None:
    if not (isinstance(alpha, int | float) and 0.0 <= alpha < 1.0):
        raise ValueError(f"alpha (acceptance rate) must be in [0, 1), got {alpha!r}")


def _check_gamma(gamma: int) -> None:
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"gamma (draft tokens per step) must be an integer >= 0, got {gamma!r}")
