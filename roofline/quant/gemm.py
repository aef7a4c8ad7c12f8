"""The matmul of each quantized format, on whatever device the layer lives: the one place that picks a kernel.

Every function takes activations ``x`` [..., K] in the model dtype and returns [..., N] in that dtype.

- GPU (Triton kernels on, ``roofline.layers.dispatch``): for weight-only INT4/INT8 either the fused kernel
  (``roofline.kernels.quant_gemm``, dequantize in registers) or dequantize-then-cuBLAS, chosen per
  (format, M, N, K) by ``use_fused`` from the table measured on the device; INT8 W8A8 is the Triton INT8
  tensor-core GEMM after the Triton per-token quantizer; FP8 is ``torch._scaled_mm`` (FP8 tensor cores,
  row-wise scales) on compute capability >= 8.9.
- CPU: torch's own low-bit kernels (``torch._weight_int8pack_mm`` for W8A16, ``torch._weight_int4pack_mm_for_cpu``
  for W4A16, ``torch._int_mm`` for W8A8 INT8). FP8 on CPU, or on a GPU without FP8 tensor cores, is
  emulated: E4M3 values (activations rounded per token, weights per channel) multiplied in float32, the
  arithmetic of an FP8 tensor core with float32 accumulation; the log says so once.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from roofline.layers.dispatch import kernels_for
from roofline.quant.quantize import ChannelWeight, Int4Weight, quantize_per_token_fp8, quantize_per_token_int8

logger = logging.getLogger(__name__)

# Measured fused-vs-dequantize tables (bench/gpu_quant_gemm.py's "dispatch"), by the device name torch reports.
_TABLES = Path(__file__).with_name("dispatch_tables")
# Without a measured table: the fused kernel up to this M. Weight-only decode (M <= batch) is bound by the
# weight bytes, which the fused kernel reads once in 4 or 8 bits; from here the GEMM is compute-bound and the
# dequantize pass (read packed, write 16-bit, cuBLAS reads it) costs less than the fused kernel's slower tiles.
DEFAULT_FUSED_MAX_M = 64


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _finish(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _quant_kernels(x: torch.Tensor):
    """``roofline.kernels.quant_gemm`` when the Triton kernels are on and ``x`` is on a GPU, else None."""
    if kernels_for(x) is None:
        return None
    from roofline.kernels import quant_gemm

    return quant_gemm


@functools.cache
def dispatch_table(device_name: str) -> dict[str, list[dict]]:
    """``{format: [{"n", "k", "fused_max_m"}...]}`` measured on ``device_name``, or {} if none is committed."""
    path = _TABLES / (device_name.replace(" ", "_") + ".json")
    if not path.is_file():
        return {}
    return {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}


def use_fused(fmt: str, m: int, n: int, k: int, device: torch.device) -> bool:
    """Fused kernel (True) or dequantize-then-dense (False) for ``fmt`` ("int4" or "int8") at this shape:
    the measured table's largest M at which the fused kernel won for this (N, K) (the nearest measured
    shape by K, then N), else ``DEFAULT_FUSED_MAX_M``."""
    rows = dispatch_table(torch.cuda.get_device_name(device)).get(fmt) if device.type == "cuda" else None
    if not rows:
        return m <= DEFAULT_FUSED_MAX_M
    row = min(rows, key=lambda r: (abs(r["k"] - k), abs(r["n"] - n)))
    return m <= row["fused_max_m"]


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
        if use_fused("int8", x2.shape[0], q.shape[0], q.shape[1], x.device):
            out = qk.w8a16_gemm(x2, q, s)
        else:
            out = F.linear(x2, qk.dequantize_int8(q, s, x.dtype))
    elif x.device.type == "cpu" and x.dtype == torch.float32:
        out = torch._weight_int8pack_mm(x2.contiguous(), q, s)
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


def w4a16(x: torch.Tensor, layer, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] @ the layer's INT4 weight (``prepare_w4a16``'s tensors on ``layer``).T -> [..., N]."""
    x2 = _flat(x)
    g = layer.int4_group_size
    if x.device.type == "cpu":
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.float().contiguous(), layer.qweight, g,
                                                         layer.scales_and_zeros).to(x.dtype)
        return _finish(out, x, bias)
    from roofline.kernels import quant_gemm

    qw, s, z = layer.qweight, layer.scales, layer.zeros
    qk = _quant_kernels(x)
    if qk is None:
        out = quant_gemm.ref_w4a16_gemm(x2, qw, s, z, g)
    elif use_fused("int4", x2.shape[0], qw.shape[1], qw.shape[0] * 8, x.device):
        out = qk.w4a16_gemm(x2, qw, s, z, g)
    else:
        out = F.linear(x2, qk.dequantize_int4(qw, s, z, g, x.dtype))
    return _finish(out, x, bias)


# ------------------------------------------------------------------------------------------- W8A8


def prepare_int8_w8a8(w: ChannelWeight) -> dict[str, torch.Tensor]:
    """``qweight`` int8 [N, K] and ``weight_scale`` float32 [N]."""
    return prepare_w8a16(w)


def int8_w8a8(x: torch.Tensor, layer, bias: torch.Tensor | None = None) -> torch.Tensor:
    """SmoothQuant's matmul: ``x`` [..., K] quantized to INT8 per token (dynamic, symmetric, amax / 127), times
    the layer's ``qweight`` int8 [N, K] with per-channel ``weight_scale`` float32 [N], accumulated exactly in
    int32, then ``acc * x_scale[m] * w_scale[n]`` in float32 -> [..., N] in x's dtype."""
    x2 = _flat(x)
    qk = _quant_kernels(x)
    if qk is not None:
        xq, xs = qk.per_token_quant_int8(x2)
        out = qk.int8_gemm(xq, xs, layer.qweight, layer.weight_scale, x.dtype)
    else:
        xq, xs = quantize_per_token_int8(x2)
        acc = torch._int_mm(xq, layer.qweight.t())
        out = (acc.float() * xs * layer.weight_scale[None, :]).to(x.dtype)
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


def fp8_w8a8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
             dense: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 W8A8: ``x`` [..., K] rounded to E4M3 per token (dynamic, amax / 448), times ``qweight``
    float8_e4m3fn [N, K] with per-channel ``scale`` float32 [N], float32 accumulation -> [..., N] in x's dtype.
    ``dense``: the weight's E4M3 values as float32 [N, K] for the emulated path (saves the cast per call)."""
    x2 = _flat(x)
    qk = _quant_kernels(x)
    xq, xs = qk.per_token_quant_fp8(x2) if qk is not None else quantize_per_token_fp8(x2)
    if fp8_tensor_cores(x.device):
        out = torch._scaled_mm(xq, qweight.t(), scale_a=xs, scale_b=scale[None, :], out_dtype=x.dtype)
    else:
        _say_fp8_emulated(str(x.device))
        w = dense if dense is not None else qweight.float()
        out = ((xq.float() @ w.t()) * xs * scale[None, :]).to(x.dtype)
    return _finish(out, x, bias)
