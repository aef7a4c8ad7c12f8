"""Programmatic dependent launch (PDL) for the kernels of a decode step (compute capability >= 9.0).

A kernel launched with ``launch_pdl=True`` may start while the previous kernel in the stream is still running;
it must execute ``griddepcontrol.wait`` (Triton's ``gdc_wait``) before it reads anything that kernel wrote or
writes anything it reads, and it lets the *next* PDL kernel start early with ``griddepcontrol.launch_dependents``
(``gdc_launch_dependents``). Our kernels wait before their first activation load and before any store; the GEMMs
issue their first weight-tile loads before the wait (weights never depend on the previous kernel). The
attributes are captured into the decode CUDA graphs as programmatic edges. Source: CUDA C++ Programming Guide,
"Programmatic Dependent Launch and Synchronization"; PTX ISA, ``griddepcontrol``.

``MODE`` is process-wide, read at launch (so before graph capture): 0 off; for the GEMMs 1 releases the next
kernel right after the wait and 2 after the K loop (``GemmConfig.pdl`` overrides it per config); the small
kernels (norms, activation, RoPE + cache store) release right after their wait for any non-zero mode. Default 1:
on the H200 (llama-3-8b, batch 1) it made decode 2.0-2.4% faster in bf16 and 5.7% in int4, and changed nothing at
batch 64 (docs/kernels.md, "Programmatic dependent launch"); with the GEMMs alone PDL-launched it did not pay.
"""

from __future__ import annotations

import functools

import torch

MODE = 1


@functools.cache
def has_pdl(device: torch.device) -> bool:
    """True on CUDA devices of compute capability >= 9.0 (Hopper and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def mode(device: torch.device, override: int | None = None) -> int:
    """``override`` (a config's own mode) or :data:`MODE`, and 0 where ``device`` has no PDL (CPU, pre-sm_90)."""
    m = override if override is not None else MODE
    return m if m and has_pdl(device) else 0


def launch_kwargs(device: torch.device, override: int | None = None) -> dict:
    """Extra kwargs for a Triton launch whose kernel takes a ``PDL`` constexpr: {} when off."""
    m = mode(device, override)
    return {"PDL": m, "launch_pdl": True} if m else {}
