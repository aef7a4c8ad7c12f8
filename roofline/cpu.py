"""CPU feature detection for the CPU decode path (issue 32).

``detect_cpu_features`` reads the x86 flags of ``/proc/cpuinfo`` once and reports which matrix extensions
oneDNN/FBGEMM can use: AMX (``amx_tile`` with ``amx_bf16``/``amx_int8``), AVX-512 BF16 (``avx512_bf16``),
AVX-512 VNNI (``avx512_vnni``), AVX-512F. Source: Linux ``arch/x86/include/asm/cpufeatures.h`` flag names.
``startup_line`` is the one line the CLI prints to say what the machine offers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuFeatures:
    model: str  # "model name" of the first processor, "unknown" if absent
    cores: int  # logical processors listed in cpuinfo (>= 1)
    avx512f: bool
    avx512_bf16: bool
    avx512_vnni: bool
    amx_bf16: bool
    amx_int8: bool

    @property
    def best_matrix_isa(self) -> str:
        """The fastest bf16/int8 matrix path: "amx", "avx512_bf16", "avx512_vnni", "avx512" or "none"."""
        if self.amx_bf16 or self.amx_int8:
            return "amx"
        if self.avx512_bf16:
            return "avx512_bf16"
        if self.avx512_vnni:
            return "avx512_vnni"
        return "avx512" if self.avx512f else "none"


def parse_cpuinfo(text: str) -> CpuFeatures:
    """Features from the text of /proc/cpuinfo (x86 layout: "key\\t: value" lines, one block per processor).

    Only the first processor's ``flags`` and ``model name`` are read; ``cores`` counts ``processor`` lines.
    Text without flags (non-x86, containers hiding it) gives every feature False.
    """
    model, flags, cores = "unknown", set(), 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            cores += 1
        elif key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    amx_tile = "amx_tile" in flags
    return CpuFeatures(model=model, cores=max(cores, 1), avx512f="avx512f" in flags,
                       avx512_bf16="avx512_bf16" in flags, avx512_vnni="avx512_vnni" in flags,
                       amx_bf16=amx_tile and "amx_bf16" in flags, amx_int8=amx_tile and "amx_int8" in flags)


@functools.cache
def detect_cpu_features(path: str = "/proc/cpuinfo") -> CpuFeatures:
    """``parse_cpuinfo`` of ``path``, read once per process; an unreadable file gives no features."""
    try:
        with open(path) as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return parse_cpuinfo("")


def startup_line(features: CpuFeatures, dtype: str, threads: int) -> str:
    """One line: CPU model, the matrix extensions found, and the dtype and thread count in use."""
    isa = [n for n, on in (("AMX", features.amx_bf16 or features.amx_int8), ("AVX-512 BF16", features.avx512_bf16),
                           ("AVX-512 VNNI", features.avx512_vnni), ("AVX-512F", features.avx512f)) if on]
    return (f"CPU: {features.model} ({features.cores} cores; {', '.join(isa) or 'no AVX-512/AMX'}); "
            f"dtype {dtype}, {threads} thread{'s' if threads != 1 else ''}")
