"""Without CUDA the fused MoE kernel runs under Triton's CPU interpreter (set before triton compiles anything,
as in tests/kernels/conftest.py)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
