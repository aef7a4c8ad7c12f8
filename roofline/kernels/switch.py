"""Whether layers call the fused Triton kernels, decided once per process by the resolved engine config.

``EngineConfig.use_triton_kernels`` (resolved by ``EngineArgs``: on for CUDA with Triton importable,
unless the user turns it off) is applied here by the worker when it builds the model. Layers then ask
``kernels_for(x)``: the kernel namespace when kernels are on and ``x`` lives on a CUDA device, else None,
so the pure-torch ``ref_`` twins run. Kernels are imported lazily so the core runs with torch alone.
One process serves one policy at a time: the last worker built sets it.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

_enabled = False


def set_kernels_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def kernels_available() -> bool:
    """True when the Triton kernel modules import (triton installed)."""
    return _load_kernels() is not None


@functools.cache
def _load_kernels() -> SimpleNamespace | None:
    try:
        import triton  # noqa: F401

        from roofline.kernels import activation, rmsnorm
    except Exception:  # triton missing or kernels unavailable: pure-torch path
        return None
    return SimpleNamespace(
        rmsnorm=rmsnorm.rmsnorm,
        fused_add_rmsnorm=rmsnorm.fused_add_rmsnorm,
        silu_and_mul=activation.silu_and_mul,
    )


def kernels_for(x: torch.Tensor) -> SimpleNamespace | None:
    """The Triton kernel namespace when kernels are enabled and ``x`` is on a CUDA device, else None."""
    return kernels_on(x.device)


def kernels_on(device: torch.device) -> SimpleNamespace | None:
    """:func:`kernels_for` by device: the namespace when kernels are enabled and ``device`` is a CUDA device."""
    if not (_enabled and device.type == "cuda"):
        return None
    return _load_kernels()
