"""16-bit linears on CPU with the weight packed once for oneDNN, instead of on every call.

``F.linear`` on bf16 CPU tensors runs oneDNN's matmul (AVX-512 BF16 dot products, or AMX tiles), but the weight
arrives in torch's plain [N, K] layout, so every call first reorders it into oneDNN's blocked layout: at decode
sizes that reorder reads and writes the whole weight again, about as costly as the product. Inductor's CPU
"freezing" pass avoids it by packing each weight once (``torch.ops.mkldnn._reorder_linear_weight``) and calling
``torch.ops.mkldnn._linear_pointwise`` with the packed tensor; this module does the same at load.

Same kernel, same numerics: on the Intel Xeon (AMX) of 2026-12-04 the packed product was bit-identical to
``F.linear`` for the default model's five linear shapes at M = 1, 2, 7, 32 and 100 (tests/cpu/test_cpu_bf16.py
checks it within bf16 rounding wherever it runs). Measured there (2 threads, 8 layers' worth of distinct
weights, alternated in one process, another job on the cores): 1.63x ``F.linear`` at M = 1, 1.51x at M = 32;
no gain in fp32 (0.88x at M = 1, 1.07x at M = 32), so only bf16 weights are packed.

``PREPACK`` (module-wide, read when a model's weights are processed after loading; 0/1 from the environment
``ROOFLINE_CPU_PREPACK``, default on) turns it off for A/B measurements.
"""

from __future__ import annotations

import functools
import os

import torch

PREPACK = os.environ.get("ROOFLINE_CPU_PREPACK", "1") != "0"


@functools.cache
def _cpu_has_bf16_units() -> bool:
    """oneDNN has bf16 arithmetic on this CPU (AVX-512 BF16 or AMX-BF16): where bf16 is fast at all."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in text or "amx_bf16" in text


def should_prepack(weight: torch.Tensor) -> bool:
    """Pack ``weight`` (a 2-D linear weight [N, K]): bf16, on a CPU with bf16 units, packing on."""
    return (PREPACK and weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and _cpu_has_bf16_units())


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` bf16 [N, K] -> an opaque oneDNN tensor (same bytes, blocked layout) for :func:`packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] bf16 @ the packed [N, K] weight^T (+ ``bias`` [N]) -> [..., N] bf16, as ``F.linear``."""
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])
