"""The bound beside a prediction from measured kernels: what a ``--quantization`` run reads per decode step, and
how long its step takes when each projection runs the kernel the engine's dispatch picks.

Two numbers per (quantization, batch), never mixed up:

- **bound**: the engine's bytes per decode step (:func:`quantized_weight_bytes_per_step`: codes + scales + zero
  points of every quantized linear layer, the LM head, norms and biases in 16 bits, the input embedding's rows
  only) plus the batch's KV, over the device bandwidth; or FLOPs over peak (Pope et al. 2022). It equals the
  ``floor`` that ``roofline bench decode`` prints, counted from the real tensors by
  ``Worker.weight_bytes_per_step`` (the tests check the two agree to the byte for Llama-3-8B).
- **predicted (measured kernels)**: per decoder layer, the projections (qkv, o, gate_up, down) at M = batch rows,
  each the GPU time of the kernel ``roofline.kernels.linear_dispatch`` runs there, measured on the device (cold L2,
  inside a CUDA graph; linear in M between measured M, never extrapolated above the largest); plus everything
  else of the step (attention, norms, RoPE, the LM head, sampling) taken from a measured bf16 decode step minus
  its own projection kernels. That rest also absorbs how much the step's back-to-back kernels overlap against
  the same kernels timed one by one, so it can be small or even negative; it is a calibration, stated as such.
  At another context than the calibration's, the rest moves by the KV bytes difference at the calibration run's
  measured read bandwidth.

The measured table (``measured_tables/<device>.json``) is built from the committed benchmark JSONs by
:mod:`roofline.costmodel.measured_build`, which names every source. Pure Python; no torch import.
"""

from __future__ import annotations

import bisect
import functools
import json
from pathlib import Path
from typing import Any

from roofline.costmodel.common import _check_count, _check_non_negative, _check_positive

# vLLM's ``--quantization`` methods quantized at load (plus "none"), as the engine lays them out on a GPU:
# (code bits per weight, bytes per output channel, bytes per (group, output channel)), group size 128 for int4.
ENGINE_QUANTIZATIONS: dict[str, tuple[int, int, int]] = {
    "none": (16, 0, 0),          # the model dtype (bf16)
    "int4": (4, 0, 2 + 2),       # qweight int32 [K/8, N]; scales and zeros in bf16 [K/G, N] (linear_dispatch)
    "int8": (8, 4, 0),           # W8A16: qweight int8 [N, K], weight_scale float32 [N]
    "fp8": (8, 4, 0),            # float8_e4m3fn [N, K], per-channel float32 scale
    "smoothquant": (8, 4, 0),    # W8A8 INT8 codes, per-channel float32 scale (smoothing folded into the norm)
}
INT4_GROUP_SIZE = 128
_TABLES = Path(__file__).with_name("measured_tables")
# ``--hardware`` preset -> the device name torch reports (the measured table's file name).
HARDWARE_DEVICES = {"h200": "NVIDIA H200"}


def _check_quantization(quantization: str) -> None:
    if quantization not in ENGINE_QUANTIZATIONS:
        raise ValueError(f"unknown --quantization {quantization!r}; known: {', '.join(ENGINE_QUANTIZATIONS)}")


def projection_bytes(n: int, k: int, quantization: str, group_size: int = INT4_GROUP_SIZE) -> int:
    """Bytes the engine stores (and a decode step reads) for one [N, K] linear weight under ``quantization``:
    codes ``N x K x bits / 8`` + per-channel scales ``N x 4`` (int8, fp8, smoothquant) or per-group scale and zero
    point ``K / G x N x (2 + 2)`` (int4, bf16 each).

    Raises:
        ValueError: an unknown quantization (lists the known ones), or K not a multiple of the group size for int4.
    """
    _check_quantization(quantization)
    _check_count("n", n)
    _check_count("k", k)
    bits, per_channel, per_group = ENGINE_QUANTIZATIONS[quantization]
    if per_group and k % group_size:
        raise ValueError(f"K = {k} is not a multiple of the int4 group size {group_size}")
    groups = k // group_size if per_group else 0
    return n * k * bits // 8 + n * per_channel + groups * n * per_group


def quantized_weight_bytes_per_step(shape: Any, quantization: str, group_size: int = INT4_GROUP_SIZE) -> int:
    """Weight bytes one decode step reads under ``quantization`` (the floor's weight term, as
    ``Worker.weight_bytes_per_step`` counts the real tensors): every decoder layer's projections in the quantized
    layout (:func:`projection_bytes`), everything else in 16 bits (norms, biases, the LM head; the input embedding
    only when it is the LM head, as a step reads just its tokens' rows). Llama-3-8B: none 15,009,849,344; int4
    4,758,970,368 (codes 3.49 GB + scales and zeros 0.22 GB + LM head 1.05 GB); int8 and fp8 8,036,032,512.

    Args:
        shape: a :class:`roofline.costmodel.ModelShape` with ``intermediate_size`` and ``vocab_size``.

    Raises:
        ValueError: the shape lacks ``intermediate_size`` or ``vocab_size``, or an unknown quantization.
    """
    return sum(weight_bytes_split(shape, quantization, group_size))


def weight_bytes_split(shape: Any, quantization: str, group_size: int = INT4_GROUP_SIZE) -> tuple[int, int]:
    """:func:`quantized_weight_bytes_per_step` in its two parts: (the decoder layers' projections in the quantized
    layout, everything else a step reads in 16 bits). Llama-3-8B int4: (3,707,764,736, 1,051,205,632).

    Raises:
        ValueError: as :func:`quantized_weight_bytes_per_step`.
    """
    _check_quantization(quantization)
    if shape.vocab_size <= 0:
        raise ValueError(f"model {shape.name!r} has no vocab_size: its LM head bytes are unknown")
    proj = shape.projection_shapes()
    linear = sum(n * k for n, k in proj.values())
    rest = shape.num_params - shape.num_layers * linear - (0 if shape.tie_word_embeddings else shape.embedding_params)
    quant = sum(projection_bytes(n, k, quantization, group_size) for n, k in proj.values())
    return shape.num_layers * quant, int(round(2 * rest))


# --------------------------------------------------------------------------------------------------
# The measured table and the prediction
# --------------------------------------------------------------------------------------------------

@functools.cache
def _load(device: str) -> dict[str, Any] | None:
    path = _TABLES / (device.replace(" ", "_") + ".json")
    return json.loads(path.read_text()) if path.is_file() else None


def measured_table(hardware: str) -> dict[str, Any] | None:
    """The measured kernel table for a ``--hardware`` preset or device name (``h200`` or ``NVIDIA H200``), or
    None when none is committed (then only the bound is printed)."""
    return _load(HARDWARE_DEVICES.get(hardware, hardware))


def _interp(points: list[list[Any]], m: float) -> float | None:
    """Linear in M between the measured ``[m, value, ...]`` points (sorted by m); the first point's value below
    it; None above the last (never extrapolated)."""
    ms = [p[0] for p in points]
    if m > ms[-1]:
        return None
    i = bisect.bisect_left(ms, m)
    if ms[i] == m or i == 0:
        return float(points[i][1])
    (m0, v0), (m1, v1) = points[i - 1][:2], points[i][:2]
    return v0 + (v1 - v0) * (m - m0) / (m1 - m0)


def kernel_us(table: dict[str, Any], quantization: str, projection: str, m: int) -> tuple[float, str] | None:
    """GPU microseconds of ``projection`` at ``m`` rows under ``quantization`` (the dispatch's kernel, linear in M
    between measured M) and that kernel's path at the nearest measured M at or above ``m``; None where ``m`` is
    above the largest measured M or the quantization has no measured kernels."""
    points = table["kernels_us"].get(quantization, {}).get(projection)
    if not points:
        return None
    us = _interp(points, m)
    if us is None:
        return None
    path = next(p[2] for p in points if p[0] >= m)
    return us, path


def why_not_predicted(table: dict[str, Any] | None, shape: Any, quantization: str, batch: int,
                      calibration: dict[str, Any] | None = None) -> str | None:
    """Why no prediction can be made for this (model, quantization, batch), or None when one can."""
    if table is None:
        return "no measured kernel table for this --hardware (roofline/costmodel/measured_tables/)"
    cal = calibration or table["calibration"]
    m = table["model"]
    try:
        proj = shape.projection_shapes()
    except ValueError as e:
        return str(e)
    if ({k: list(v) for k, v in proj.items()} != m["projections"] or shape.num_layers != m["num_layers"]
            or shape.vocab_size != m["vocab_size"]):
        return (f"kernels measured for {m['name']} only ({m['num_layers']} layers, projections "
                f"{', '.join(f'{k} {n}x{kk}' for k, (n, kk) in m['projections'].items())}, vocab {m['vocab_size']})")
    if quantization not in table["kernels_us"]:
        return f"no kernel times measured for --quantization {quantization} on {table['device']}"
    top = min(pts[-1][0] for pts in table["kernels_us"][quantization].values())
    if batch > top:
        return f"{quantization} kernels measured up to M = {top} only (batch {batch})"
    if batch > cal["steps"][-1][0]:
        return f"the bf16 calibration step was measured up to batch {cal['steps'][-1][0]} only"
    return None


def predict_decode_step(table: dict[str, Any], shape: Any, quantization: str, batch: int, context: int,
                        kv_bytes_per_sequence: float, calibration: dict[str, Any] | None = None) -> dict[str, Any]:
    """Predicted decode-step time (seconds) from measured kernels; see the module docstring for the model.

    Args:
        table: :func:`measured_table`'s dict.
        shape: the model (a :class:`roofline.costmodel.ModelShape`; it must be the table's model).
        quantization: a key of the table's ``kernels_us`` (:data:`ENGINE_QUANTIZATIONS`' names, and
            ``int4_triton``: INT4 without the tensor-core kernel).
        batch: sequences per step (the GEMMs' M).
        context: tokens of KV per sequence.
        kv_bytes_per_sequence: KV bytes one sequence reads per step at ``context`` (for the context shift).
        calibration: another measured bf16 run in the table's ``calibration`` form (e.g. one from the same process
            as the run being predicted); default the table's.

    Returns:
        ``predicted_s``, ``projections_s`` (all layers), ``rest_s``, ``kernels`` ({projection: {"us", "path"}})
        and ``calibration`` (its source).

    Raises:
        ValueError: :func:`why_not_predicted` has a reason (it is the message).
    """
    _check_count("batch", batch)
    _check_non_negative("context", context)
    _check_non_negative("kv_bytes_per_sequence", kv_bytes_per_sequence)
    why = why_not_predicted(table, shape, quantization, batch, calibration)
    if why is not None:
        raise ValueError(why)
    cal = calibration or table["calibration"]
    layers = table["model"]["num_layers"]

    def projections_s(q: str) -> tuple[float, dict[str, dict[str, Any]]]:
        kernels = {}
        for name in table["model"]["projections"]:
            us, path = kernel_us(table, q, name, batch)  # type: ignore[misc]  # checked by why_not_predicted
            kernels[name] = {"us": us, "path": path}
        return layers * sum(k["us"] for k in kernels.values()) * 1e-6, kernels

    base_s, _ = projections_s(cal["quantization"])
    step_s = _interp(cal["steps"], batch)
    _check_positive("calibration step", step_s)  # type: ignore[arg-type]
    kv_shift = batch * (kv_bytes_per_sequence - cal["kv_bytes_per_sequence"]) / cal["read_bandwidth_bytes_per_s"]
    rest_s = step_s - base_s + kv_shift  # type: ignore[operator]
    proj_s, kernels = projections_s(quantization)
    return {"quantization": quantization, "batch": batch, "context": context, "predicted_s": rest_s + proj_s,
            "projections_s": proj_s, "rest_s": rest_s, "kv_shift_s": kv_shift, "kernels": kernels,
            "calibration": {"source": cal["source"], "quantization": cal["quantization"],
                            "context": cal["context"], "step_s": step_s, "projections_s": base_s}}
