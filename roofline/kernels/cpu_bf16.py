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


def pack_layer(layer) -> None:
    """After loading: ``layer.packed_weight`` = :func:`prepack` of ``layer.weight`` where :func:`should_prepack`,
    else None (the linear methods that keep a dense 16-bit weight call this)."""
    layer.packed_weight = prepack(layer.weight) if should_prepack(layer.weight) else None


def layer_linear(layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x`` @ ``layer.weight``^T (+ ``bias``) through the packed copy (and :func:`gemv` at one row) where
    :func:`pack_layer` made one and ``x`` is bf16 on the CPU; None otherwise (the caller's own path)."""
    packed = getattr(layer, "packed_weight", None)
    if packed is None or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return None
    return packed_linear(x, packed, bias, dense=layer.weight)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                  dense: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] bf16 @ the packed [N, K] weight^T (+ ``bias`` [N]) -> [..., N] bf16, as ``F.linear``.
    One row with ``dense`` (the same weight, row-major [N, K] bf16) goes through :func:`gemv` where it applies."""
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if dense is not None and x2.shape[0] == 1 and (y := gemv(x2, dense, bias)) is not None:
        out = y
    else:
        out = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


# The one-row GEMV and the fused add + RMSNorm (C++, the library of roofline.kernels.cpu_paged_attention);
# ROOFLINE_CPU_GEMV=0 turns both off.
GEMV = os.environ.get("ROOFLINE_CPU_GEMV", "1") != "0"


def _cpp_library():
    """The compiled library where ``GEMV`` is on and it built, else None."""
    if not GEMV:
        return None
    from roofline.kernels import cpu_paged_attention as cpa

    lib = cpa._library()
    return None if isinstance(lib, str) else lib


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """One row: ``x`` [1, K] bf16 @ ``weight`` [N, K] bf16 (contiguous)^T (+ ``bias`` [N] bf16) -> [1, N] bf16, the
    products and the bias summed in fp32 and rounded once, through the C++ AVX-512 BF16 GEMV
    (``roofline_gemv_bf16``: vdpbf16ps, Intel SDM). None where it does not apply (``ROOFLINE_CPU_GEMV=0``, no
    library, no AVX-512 BF16, K not a multiple of 32, other dtypes or shapes): the caller runs oneDNN then.

    Why: at M = 1 oneDNN's packed bf16 linear streams the default model's small projections at 16-27 GB/s and
    its LM head at 44 GB/s; this loop ran them 1.2-2.2x faster (qkv 960x576 53.8 -> 28.6 us, o 576x576 40.6 ->
    18.3, gate_up 3072x576 177.5 -> 137.9, down 576x1536 66.6 -> 43.8, LM head 49152x576 1275.6 -> 1043.5; Intel
    Xeon with AMX, 2 threads, 30 distinct weights per shape, 2026-12-04)."""
    if (x.dim() != 2 or x.shape[0] != 1 or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
            or weight.dim() != 2 or x.shape[1] != weight.shape[1] or weight.shape[1] % 32 or x.device.type != "cpu"
            or not weight.is_contiguous()
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()))
            or (lib := _cpp_library()) is None):
        return None
    x = x.contiguous()
    y = torch.empty(1, weight.shape[0], dtype=torch.bfloat16)
    ok = lib.roofline_gemv_bf16(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                                y.data_ptr(), weight.shape[0], weight.shape[1], torch.get_num_threads())
    return y if ok else None


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """HF ``LlamaRMSNorm`` of bf16 rows in one C++ call (``roofline_add_rmsnorm_bf16``): ``x`` [T, H] bf16,
    ``weight`` [H] bf16; with ``residual`` [T, H] bf16 returns (rmsnorm(x + residual), x + residual), the add
    rounded to bf16 first (``roofline.kernels.rmsnorm.ref_fused_add_rmsnorm``'s numerics), else rmsnorm(x).
    The sum of squares runs in fp32 in another order than torch's ``mean`` (so the last bit can differ); every
    other rounding is the reference's. None where it does not apply (not bf16 2-D contiguous rows on CPU, no
    library, ``ROOFLINE_CPU_GEMV=0``): the caller runs the reference. It replaces ~9 small torch ops per call,
    each ~5-10 us at decode sizes."""
    if (x.device.type != "cpu" or x.dim() != 2 or x.dtype != torch.bfloat16
            or weight.dtype != torch.bfloat16 or not x.is_contiguous() or not weight.is_contiguous()
            or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                          or not residual.is_contiguous()))
            or (lib := _cpp_library()) is None):
        return None
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    lib.roofline_add_rmsnorm_bf16(x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(),
                                  out.data_ptr(), 0 if res_out is None else res_out.data_ptr(), x.shape[0],
                                  x.shape[1], float(eps), torch.get_num_threads())
    return out if residual is None else (out, res_out)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` [T, 2I] bf16 (contiguous, CPU) -> [T, I] bf16 = bf16(bf16(silu(gate)) * up), the rounding of
    ``roofline.kernels.activation.ref_silu_and_mul`` (torch's bf16 silu, then its bf16 multiply), in one C++ pass
    (``roofline_silu_mul_bf16``) instead of a silu, a multiply and two slices; the fp32 exp is the C library's, not
    torch's SLEEF one, so a rare product can differ in its last bf16 bit. None where it does not apply (another
    dtype or layout, no library, ``ROOFLINE_CPU_GEMV=0``): the caller runs the reference."""
    if (x.device.type != "cpu" or x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] % 2
            or not x.is_contiguous() or (lib := _cpp_library()) is None):
        return None
    half = x.shape[1] // 2
    out = torch.empty(x.shape[0], half, dtype=torch.bfloat16)
    lib.roofline_silu_mul_bf16(x.data_ptr(), out.data_ptr(), x.shape[0], half, torch.get_num_threads())
    return out
