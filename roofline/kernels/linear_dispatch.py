"""The matmul of each quantized format, on whatever device the layer lives: the one place that picks a kernel.

(Was ``roofline.quant.gemm``, which stays an alias of this module.)

Every function takes activations ``x`` [..., K] in the model dtype and returns [..., N] in that dtype.

- GPU (Triton kernels on, ``roofline.kernels.switch``), chosen per (format, M, N, K) by ``use_fused`` and
  ``kernel_config`` from the table ``bench/gpu_quant_sweep.py`` measured on the device:
  - weight-only INT4/INT8: our kernel (``roofline.kernels.quant_gemm``: the GEMV at M <= 4, tiled tl.dot above,
    dequantized in registers) or dequantize-then-cuBLAS;
  - W8A8 (INT8 SmoothQuant, FP8): at M <= 4 the GEMV that quantizes x per token itself (one launch); above,
    the Triton per-token quantizer then the Triton INT8 tensor-core GEMM or ``torch._scaled_mm`` (FP8 tensor
    cores, row-wise scales, compute capability >= 8.9). FP8 at decode sizes (``use_fused("fp8_w8a16")``, M <= 16
    without a table) runs weight-only instead: ``quant_gemm.fp8_w8a16_gemm``. Where the quantizer would run
    (``input_quant_format``), the producer of x may have run it already, fused into its own kernel (RMSNorm,
    SiLU-and-mul: ``roofline.kernels.act_quant.rmsnorm_quant``): x then comes as a ``QuantizedActivation``;
  - 16-bit (``dense_linear``, the unquantized method): our split-K GEMV where it beat cuBLAS, else F.linear.
- CPU: torch's own low-bit kernels: ``torch._int_mm`` for INT8 with activations quantized per token
  (``roofline.kernels.cpu_int8``; SmoothQuant's W8A8, and ``--quantization int8`` too, since torch's CPU W8A16
  kernel was slower than fp32), ``torch._weight_int4pack_mm_for_cpu`` for W4A16. FP8 on CPU, or on a GPU
  without FP8 tensor cores, is emulated: E4M3 values (activations rounded per token, weights per channel)
  multiplied in float32, the arithmetic of an FP8 tensor core with float32 accumulation; the log says so once.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from roofline.kernels.act_quant import QuantizedActivation
from roofline.kernels.quant_types import (
    ChannelWeight,
    Int4Weight,
    quantize_per_token_fp8,
)
from roofline.kernels.switch import kernels_for, kernels_on

logger = logging.getLogger(__name__)

# Measured dispatch tables (bench/gpu_quant_sweep.py --table), by the device name torch reports.
_TABLES = Path(__file__).with_name("dispatch_tables")
# Without a measured table, our kernel up to this M, per format. Weight-only decode (M <= batch) is bound by the
# weight bytes, which the fused kernel reads once in 4 or 8 bits; from here the GEMM is compute-bound and the
# dequantize pass (read packed, write 16-bit, cuBLAS reads it) costs less than the fused kernel's slower tiles.
# W8A8 at M <= 4: the GEMV that quantizes x itself (one launch instead of two). Dense: cuBLAS.
DEFAULT_FUSED_MAX_M = {"int4": 64, "int8": 64, "int8_int8": 4, "fp8": 4, "dense": 0, "fp8_w8a16": 16}
GEMV_MAX_M = 4  # the GEMV kernels' range (roofline.kernels.quant_gemv)
TILED_MIN_M = 16  # the smallest M a table's tiled rows are swept at (bench/gpu_quant_sweep.TILED_M): they serve below


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _finish(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _row_parallel(layer) -> bool:
    """Whether ``layer`` holds K / tp input columns (row-parallel under TP): per-token scales span the ranks."""
    return getattr(layer, "tp_size", 1) > 1 and getattr(layer, "input_is_parallel", False)


def _quant_kernels(x: torch.Tensor):
    """``roofline.kernels.quant_gemm`` when the Triton kernels are on and ``x`` is on a GPU, else None."""
    if kernels_for(x) is None:
        return None
    from roofline.kernels import quant_gemm

    return quant_gemm


@functools.cache
def dispatch_table(device_name: str) -> dict:
    """``{"gemv": {fmt: [{"n", "k", "m", "config"}]}, "fused_max_m": {fmt: [{"n", "k", "fused_max_m"}]}}`` measured on
    ``device_name`` (``roofline/kernels/dispatch_tables/<name>.json``), or {} if none is committed."""
    path = _TABLES / (device_name.replace(" ", "_") + ".json")
    if not path.is_file():
        return {}
    return {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}


def _table(device: torch.device) -> dict:
    return dispatch_table(torch.cuda.get_device_name(device)) if device.type == "cuda" else {}


def _nearest(rows: list[dict], n: int, k: int) -> dict:
    return min(rows, key=lambda r: (abs(r["k"] - k), abs(r["n"] - n)))


def use_fused(fmt: str, m: int, n: int, k: int, device: torch.device) -> bool:
    """Our kernel (True) or the other path (False) for ``fmt`` at this shape: dequantize-then-cuBLAS for "int4"
    and "int8", quantize-then-tensor-core GEMM for "int8_int8" and "fp8", cuBLAS for "dense". The measured
    table's largest winning M for the nearest measured (N, K) (by K, then N), else ``DEFAULT_FUSED_MAX_M``."""
    rows = _table(device).get("fused_max_m", {}).get(fmt)
    limit = _nearest(rows, n, k)["fused_max_m"] if rows else DEFAULT_FUSED_MAX_M[fmt]
    if fmt in ("int8_int8", "fp8", "dense"):
        limit = min(limit, GEMV_MAX_M)  # only the GEMV is ours for these
    return m <= limit


def kernel_config(fmt: str, m: int, n: int, k: int, device: torch.device):
    """The measured fastest config of our kernel for ``fmt`` at ``m`` rows and the nearest measured (N, K), or None
    (``quant_gemm.CONFIGS``' default): at ``m <= GEMV_MAX_M`` the table's ``gemv`` rows (the M = 1 row for m = 1,
    the M = 4 row otherwise); above, its ``tiled`` rows (the row of the smallest measured M >= m; None past the
    largest, and None below a smallest measured M over ``TILED_MIN_M`` that is at least twice m)."""
    from roofline.kernels.quant_gemm import GemmConfig

    table = _table(device)
    if m <= GEMV_MAX_M:
        rows = [r for r in table.get("gemv", {}).get(fmt, []) if r["m"] == (1 if m == 1 else 4)]
        return GemmConfig(**_nearest(rows, n, k)["config"]) if rows else None
    rows = table.get("tiled", {}).get(fmt)
    if not rows:
        return None
    near = _nearest(rows, n, k)
    same = [r for r in rows if (r["n"], r["k"]) == (near["n"], near["k"])]
    above = [r for r in same if r["m"] >= m]
    if not above:
        return None
    row = min(above, key=lambda r: r["m"])
    if m * 2 <= row["m"] and row["m"] > TILED_MIN_M and not any(r["m"] < m for r in same):
        return None  # nothing measured near this M (a table swept at large M only): not a tile twice its size
    return GemmConfig(**row["config"])


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] @ ``weight`` [N, K]^T (+ bias): our split-K GEMV where the measured table says it beats
    cuBLAS at this M and shape (decode on small projections), else ``F.linear``."""
    qk = _quant_kernels(x)
    if qk is not None and x.dtype == weight.dtype:
        x2 = _flat(x)
        m, (n, k) = x2.shape[0], weight.shape
        if use_fused("dense", m, n, k, x.device):
            return _finish(qk.dense_gemv(x2, weight, config=kernel_config("dense", m, n, k, x.device)), x, bias)
    return F.linear(x, weight, bias)


# ------------------------------------------------------------------------------------------- W8A16


def prepare_w8a16(w: ChannelWeight) -> dict[str, torch.Tensor]:
    """``qweight`` int8 [N, K] and ``weight_scale`` float32 [N] (the kernels' and torch's CPU layout)."""
    return {"qweight": w.q.to(torch.int8).contiguous(), "weight_scale": w.scales.float().contiguous()}


def w8a16(x: torch.Tensor, layer, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] @ (``layer.qweight`` int8 [N, K] * ``layer.weight_scale`` [N]).T (+ bias) -> [..., N]."""
    x2 = _flat(x)
    q, s = layer.qweight, layer.weight_scale
    qk = _quant_kernels(x)
    if qk is not None:
        m, (n, k) = x2.shape[0], q.shape
        if use_fused("int8", m, n, k, x.device):
            out = qk.w8a16_gemm(x2, q, s, config=kernel_config("int8", m, n, k, x.device))
        else:
            out = F.linear(x2, qk.dequantize_int8(q, s, x.dtype))
    elif x.device.type == "cpu":  # W8A8 dynamic: torch's CPU W8A16 kernel is slower than fp32 (issue 32)
        from roofline.kernels.cpu_int8 import w8a8_dynamic_linear

        return w8a8_dynamic_linear(x, q, s, bias, row_parallel=_row_parallel(layer),
                                   packed=getattr(layer, "tile_qweight", None))
    else:
        out = F.linear(x2.float(), q.float() * s[:, None]).to(x.dtype)
    return _finish(out, x, bias)


# ------------------------------------------------------------------------------------------- W4A16


def prepare_w4a16(w: Int4Weight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors ``w4a16`` reads for an ``Int4Weight`` with contiguous groups, on ``w.q``'s device.

    CPU: torch's int4 weight-packed layout (``_convert_weight_to_int4pack_for_cpu``) and ``scales_and_zeros``
    float32 [K / G, N, 2] holding ``s`` and ``(8 - z) * s`` (its kernel computes ``(q - 8) * s + zf``, which
    equals ``(q - z) * s``). Elsewhere: ``roofline.kernels.quant_gemm.prepare_int4``'s layout (``qweight``
    int32 [K / 8, N], ``scales`` and ``zeros`` [K / G, N] in ``dtype``).
    """
    if w.q.device.type == "cpu":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32).contiguous(), 1)
        s = w.scales.float()
        zf = (8.0 - w.zeros.float()) * s
        return {"qweight": packed, "scales_and_zeros": torch.stack([s.t(), zf.t()], dim=-1).contiguous()}
    from roofline.kernels.quant_gemm import prepare_int4

    p = prepare_int4(w, dtype)
    return {"qweight": p.qweight, "scales": p.scales, "zeros": p.zeros}


_MMA_SKIPPED: set[str] = set()
_INT4_MMA_MAX_M = 64  # roofline.kernels.w4a16_mma.MMA_MAX_M


_MMA_ROWS: dict[tuple, tuple] = {}  # (table key, id(rows), m, n, k) -> (rows, MmaConfig | None)


def _measured_mma(key: str, m: int, n: int, k: int, device: torch.device, default_max_m: int):
    """The measured table's ``key`` rows (``int4_mma``) for the nearest (N, K): the row
    of the smallest measured M >= ``m`` (its fastest config, if it beat the Triton path there, else None); without
    rows, or above the largest measured M, ``w4a16_mma.pick_tile`` up to ``default_max_m`` (its wgmma tiles above
    M = 16 on an sm_90 device). Cached per (rows, m, n, k): a decode step asks once per
    layer (the cache keeps the rows alive, so their id is not reused)."""
    from roofline.kernels.w4a16_mma import MmaConfig, pick_tile

    rows = _table(device).get(key)
    ck = (key, id(rows), m, n, k)
    hit = _MMA_ROWS.get(ck)
    if hit is not None:
        return hit[1]
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    if not rows:
        cfg = pick_tile(m, hopper) if m <= default_max_m else None
    else:
        near = _nearest(rows, n, k)
        same = sorted((r for r in rows if (r["n"], r["k"]) == (near["n"], near["k"])), key=lambda r: r["m"])
        row = next((r for r in same if r["m"] >= m), None)
        if row is None:  # above every measured M: the default tile for m rows (a smaller M's tile cannot take them)
            cfg = pick_tile(m, hopper) if m <= default_max_m else None
        else:
            cfg = None if row["us"] > row["triton_us"] else MmaConfig(**row["config"])
    _MMA_ROWS[ck] = (rows, cfg)
    return cfg


def int4_mma_config(m: int, n: int, k: int, device: torch.device):
    """The INT4 tensor-core kernel's config for ``m`` rows of an [N, K] weight (a ``w4a16_mma.MmaConfig``), or None
    where the Triton INT4 path is faster: the measured table's ``int4_mma`` rows (``_measured_mma``); without a
    table, ``w4a16_mma.pick_tile`` up to M = 64."""
    if m > _INT4_MMA_MAX_M:
        return None
    return _measured_mma("int4_mma", m, n, k, device, _INT4_MMA_MAX_M)


def prepare_w4a16_mma(qweight: torch.Tensor, group_size: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``{"qweight_mma": ...}``: the tensor-core layout of ``prepare_w4a16``'s GPU ``qweight`` for decode-sized M
    (``roofline.kernels.w4a16_mma``), or {} where that kernel does not apply (the reason is logged once per
    reason). Held as a non-persistent buffer beside ``qweight`` (which serves larger M): a step reads one."""
    from roofline.kernels import w4a16_mma

    k, n = qweight.shape[0] * 8, qweight.shape[1]
    why = w4a16_mma.mma_supported(n, k, group_size, dtype, qweight.device)
    if why is not None:
        if qweight.device.type == "cuda" and why not in _MMA_SKIPPED:
            _MMA_SKIPPED.add(why)
            logger.info("INT4 tensor-core decode GEMM (Gluon) not used: %s; the Triton INT4 kernels run", why)
        return {}
    return {"qweight_mma": w4a16_mma.repack_int4_mma(qweight)}


# Above this M the CPU path dequantizes the layer and runs one fp32 GEMM: torch's int4 kernel costs time linear in
# M (measured on the 2-core AVX-512 machine, N=3072 K=576 G=64: 13.6 ms at M=1, 47 at 4, 579 at 64, 2281 at 256,
# against 46 / 48 / 40 / 69 ms for dequantize + F.linear).
CPU_INT4_KERNEL_MAX_M = 4


def prepare_w4a16_cpu_prefill(w: Int4Weight) -> dict[str, torch.Tensor]:
    """The CPU prefill copy of an INT4 weight (``w4a16`` at M > ``CPU_INT4_KERNEL_MAX_M``): codes uint8 [N, K],
    scales and zeros float32 [N, K / G]. Held as non-persistent buffers beside torch's packed layout (1 more byte
    per weight in memory; a decode step reads only the packed 4-bit one, which ``weight_bytes`` counts)."""
    return {"prefill_q": w.q.to(torch.uint8).contiguous(), "prefill_scales": w.scales.float().contiguous(),
            "prefill_zeros": w.zeros.float().contiguous()}


def w4a16(x: torch.Tensor, layer, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] @ the layer's INT4 weight (``prepare_w4a16``'s tensors on ``layer``).T -> [..., N]."""
    x2 = _flat(x)
    g = layer.int4_group_size
    if x.device.type == "cpu":
        if x2.shape[0] <= CPU_INT4_KERNEL_MAX_M or not hasattr(layer, "prefill_q"):
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.float().contiguous(), layer.qweight, g,
                                                             layer.scales_and_zeros)
        else:
            q, sc, zr = layer.prefill_q, layer.prefill_scales, layer.prefill_zeros
            n, k = q.shape
            w = ((q.view(n, k // g, g).float() - zr[:, :, None]) * sc[:, :, None]).view(n, k)
            out = F.linear(x2.float(), w)
        return _finish(out.to(x.dtype), x, bias)
    from roofline.kernels import quant_gemm

    qw, s, z = layer.qweight, layer.scales, layer.zeros
    qk = _quant_kernels(x)
    qm = getattr(layer, "qweight_mma", None)
    if qk is None:
        out = quant_gemm.ref_w4a16_gemm(x2, qw, s, z, g)
    elif (qm is not None and x2.dtype == torch.bfloat16
          and (mma := int4_mma_config(x2.shape[0], qw.shape[1], qw.shape[0] * 8, x.device)) is not None):
        from roofline.kernels.w4a16_mma import w4a16_mma_gemm

        out = w4a16_mma_gemm(x2, qm, s, z, config=mma)
    elif use_fused("int4", x2.shape[0], qw.shape[1], qw.shape[0] * 8, x.device):
        out = qk.w4a16_gemm(x2, qw, s, z, g, config=kernel_config("int4", x2.shape[0], qw.shape[1], qw.shape[0] * 8,
                                                                x.device))
    else:
        out = F.linear(x2, qk.dequantize_int4(qw, s, z, g, x.dtype))
    return _finish(out, x, bias)


# ------------------------------------------------------------------------------------------- W8A8


def prepare_int8_w8a8(w: ChannelWeight) -> dict[str, torch.Tensor]:
    """``qweight`` int8 [N, K] and ``weight_scale`` float32 [N]."""
    return prepare_w8a16(w)


def w8a8_path(method: str, m: int, n: int, k: int, device: torch.device) -> str:
    """The matmul the W8A8 linear of ``method`` ("smoothquant" or "fp8") of shape [N, K] runs for M tokens: decided
    here once, for ``int8_w8a8`` / ``fp8_w8a8`` and for the producer of their input (``input_quant_format``).
    "weight_only": FP8 at decode sizes, x stays 16-bit (``use_fused("fp8_w8a16")``); "gemv": one launch, the GEMV
    quantizes x itself (``use_fused("int8_int8")`` / ``use_fused("fp8")``); "quantize": x is quantized per token
    in a pass of its own, then the device's GEMM (the Triton INT8 GEMM, ``torch._scaled_mm``, FP8 emulation, or
    the CPU's ``_int_mm``). The first two need the Triton kernels (and, for FP8, FP8 tensor cores)."""
    if kernels_on(device) is None or (method == "fp8" and not fp8_tensor_cores(device)):
        return "quantize"
    if method == "fp8" and use_fused("fp8_w8a16", m, n, k, device):
        return "weight_only"
    return "gemv" if use_fused("fp8" if method == "fp8" else "int8_int8", m, n, k, device) else "quantize"


def input_quant_format(method: str, m: int, n: int, k: int, device: torch.device) -> str | None:
    """The per-token format, "int8" or "fp8", in which the W8A8 linear of ``method`` quantizes an input of M
    tokens in a pass of its own (``w8a8_path`` "quantize") before a GEMM that takes the codes as they are (the
    Triton INT8 GEMM, ``torch._scaled_mm``): the producer of that input (RMSNorm, SiLU-and-mul) may then write the
    codes itself, in the same kernel (``roofline.kernels.act_quant``), and hand over a ``QuantizedActivation``.
    None where the layer takes the 16-bit x: weight-only FP8, the self-quantizing GEMV, the CPU, FP8 emulation."""
    if kernels_on(device) is None or (method == "fp8" and not fp8_tensor_cores(device)):
        return None
    if w8a8_path(method, m, n, k, device) != "quantize":
        return None
    return "fp8" if method == "fp8" else "int8"


def int8_w8a8(x: torch.Tensor | QuantizedActivation, layer, bias: torch.Tensor | None = None) -> torch.Tensor:
    """SmoothQuant's matmul: ``x`` [..., K] quantized to INT8 per token (dynamic, symmetric, amax / 127), times
    the layer's ``qweight`` int8 [N, K] with per-channel ``weight_scale`` float32 [N], accumulated exactly in
    int32, then ``acc * x_scale[m] * w_scale[n]`` in float32 -> [..., N] in x's dtype. ``x`` may come quantized
    (a ``QuantizedActivation`` of format "int8", where ``input_quant_format`` says "int8")."""
    if isinstance(x, QuantizedActivation):
        qk = _quant_kernels(x.codes)
        out = qk.int8_gemm(x.codes, x.scales, layer.qweight, layer.weight_scale, x.dtype,
                           config=qk.pick_config("int8_int8", max(x.shape[0], qk.SMALL_M)))
        return _finish(out, x, bias)
    x2 = _flat(x)
    qk = _quant_kernels(x)
    if qk is not None:
        m, (n, k) = x2.shape[0], layer.qweight.shape
        if w8a8_path("smoothquant", m, n, k, x.device) == "gemv":  # one launch: the GEMV quantizes x itself
            out = qk.w8a8_gemv(x2, layer.qweight, layer.weight_scale,
                               config=kernel_config("int8_int8", m, n, k, x.device))
        else:
            xq, xs = qk.per_token_quant_int8(x2)
            out = qk.int8_gemm(xq, xs, layer.qweight, layer.weight_scale, x.dtype,
                               config=qk.pick_config("int8_int8", max(m, qk.SMALL_M)))  # tensor cores
    else:
        from roofline.kernels.cpu_int8 import w8a8_dynamic_linear

        return w8a8_dynamic_linear(x, layer.qweight, layer.weight_scale, bias, row_parallel=_row_parallel(layer))
    return _finish(out, x, bias)


@functools.cache
def fp8_tensor_cores(device: torch.device) -> bool:
    """True on CUDA devices of compute capability >= 8.9 (Ada, Hopper): FP8 E4M3 tensor cores."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def _say_fp8_emulated(device: str) -> None:
    logger.warning("fp8 W8A8 on %s is the emulated path: E4M3 values multiplied in float32 (no FP8 tensor "
                   "cores here); quality is the format's, speed is not", device)


def fp8_emulation_weight(qweight: torch.Tensor) -> torch.Tensor:
    """The E4M3 values of ``qweight`` float8_e4m3fn [N, K] as float64 [N, K], the emulated path's operand.

    float64 because it makes the emulated matmul exact, hence batch-invariant (issue 31 item 4): an E4M3 x
    E4M3 product has at most 8 significant bits and lies in [2^-18, 448^2 < 2^18], so any sum of K <= 2^16
    of them is exact in float64's 53 bits whatever the summation order. A float32 ``xq @ w.T`` is not: torch's
    CPU BLAS sums K in a different order at M = 1 (GEMV) than at M > 1 (blocked GEMM), so a request's logits
    moved with its batch-mates. Costs 8 bytes per weight on the emulated path (CPU, pre-Ada GPUs) only."""
    return qweight.to(torch.float64)


def fp8_w8a8(x: torch.Tensor | QuantizedActivation, qweight: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None = None, dense: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 W8A8: ``x`` [..., K] rounded to E4M3 per token (dynamic, amax / 448), times ``qweight``
    float8_e4m3fn [N, K] with per-channel ``scale`` float32 [N], float32 accumulation -> [..., N] in x's dtype.
    ``dense``: the weight's E4M3 values as float64 [N, K] (``fp8_emulation_weight``) for the emulated path
    (saves the cast per call). The activation scale is per token on every path (the GEMV's in-kernel rounding,
    the Triton/torch per-token quantizers), and the emulated matmul is exact (float64 accumulation of E4M3
    products), so on the emulated path a row's output is bit-identical whatever its batch-mates. ``x`` may come
    quantized (a ``QuantizedActivation`` of format "fp8", where ``input_quant_format`` says "fp8")."""
    if isinstance(x, QuantizedActivation):
        out = torch._scaled_mm(x.codes, qweight.t(), scale_a=x.scales, scale_b=scale[None, :], out_dtype=x.dtype)
        return _finish(out, x, bias)
    x2 = _flat(x)
    qk = _quant_kernels(x)
    m, (n, k) = x2.shape[0], qweight.shape
    path = w8a8_path("fp8", m, n, k, x.device)
    if path == "weight_only":
        # Decode sizes: FP8 weight-only (x stays in 16 bits, the E4M3 codes upcast in registers): the weight
        # stream without a quantization pass. Its numerics are x @ W (W the E4M3 values): closer to the
        # unquantized model than W8A8, and a request's logits differ by path (this one below the measured M).
        cfg = kernel_config("fp8_w8a16", m, n, k, x.device) or kernel_config("int8", m, n, k, x.device)
        return _finish(qk.fp8_w8a16_gemm(x2, qweight, scale, config=cfg), x, bias)
    if path == "gemv":
        # Decode sizes: one launch, x rounded to E4M3 per token inside the GEMV (the same arithmetic).
        return _finish(qk.w8a8_gemv(x2, qweight, scale, config=kernel_config("fp8", m, n, k, x.device)), x, bias)
    xq, xs = qk.per_token_quant_fp8(x2) if qk is not None else quantize_per_token_fp8(x2)
    if fp8_tensor_cores(x.device):
        out = torch._scaled_mm(xq, qweight.t(), scale_a=xs, scale_b=scale[None, :], out_dtype=x.dtype)
    else:
        _say_fp8_emulated(str(x.device))
        w = dense if dense is not None and dense.dtype == torch.float64 else fp8_emulation_weight(qweight)
        out = ((xq.double() @ w.t()).float() * xs * scale[None, :]).to(x.dtype)
    return _finish(out, x, bias)
