"""Shared setup for the Triton kernel tests.

Without CUDA the kernels run under Triton's CPU interpreter: TRITON_INTERPRET must be set before triton
compiles anything, i.e. before the kernel modules are imported (the test modules import them after this
file runs). Shared case builders and references live in kernel_cases.py.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
