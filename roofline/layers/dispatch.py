"""Chooses between the pure-torch path and the Triton kernels, once, by device.

Model code calls layers; layers ask here whether fused GPU kernels apply to a tensor. The kernels are
imported lazily so the core runs with torch alone (CPU, no Triton).
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch


@functools.cache
def _load_kernels() -> SimpleNamespace | None:
    if os.environ.get("ROOFLINE_DISABLE_KERNELS") == "1":
        return None
    try:
        from roofline.kernels import activation, rmsnorm, rope_cache
    except Exception:  # triton missing or kernels unavailable: pure-torch path
        return None
    return SimpleNamespace(
        rmsnorm=rmsnorm.rmsnorm,
        fused_add_rmsnorm=rmsnorm.fused_add_rmsnorm,
        silu_and_mul=activation.silu_and_mul,
        rope_and_cache=rope_cache.rope_and_cache,
    )


def kernels_for(x: torch.Tensor) -> SimpleNamespace | None:
    """The Triton kernel namespace when ``x`` lives on a CUDA device and kernels import, else None."""
    if not x.is_cuda:
        return None
    return _load_kernels()
