"""Report for a real run: the measured mean decode step beside its floor."""

from __future__ import annotations

from typing import Any

from roofline.costmodel.common import _check_non_negative, _check_positive


def decode_floor_report(weight_bytes: int, kv_bytes_read: float, flops: float,
                        bandwidth_bytes_per_s: float, peak_flops: float | None,
                        measured_step_s: float, weights: str | None = None) -> dict[str, Any]:
    """The measured mean decode step beside its floor (lower bound), for the end of a run.

    Args:
        weight_bytes: bytes of the weights actually read per step (from the real tensors).
        kv_bytes_read: KV bytes read per step at the actual context lengths, summed over the batch.
        flops: FLOPs of one step (``2 x params x batch`` for plain decoding).
        bandwidth_bytes_per_s: measured (probe) or datasheet read bandwidth.
        peak_flops: FLOP/s, or ``None`` to bound by memory only.
        measured_step_s: mean measured decode-step time.
        weights: the weight format the floor is for (``"int4"``, ``"bf16"``), named in the text with its bytes.

    Returns:
        ``floor_s``, ``measured_s``, ``fraction_of_floor`` (= floor / measured, 1.0 at the floor),
        ``memory_floor_s``, ``compute_floor_s``, ``bound_by`` and ``text``, e.g.
        ``"decode step 41.2 ms, floor 12.3 ms (30% of floor)"``, with ``weights``
        ``"decode step 2.6 ms, floor 1.1 ms for int4 weights, 4.76 GB of weights + 0.00 GB of KV read per step (42% of
        floor)"`` (Pope et al. 2022
        bound). The floor is per format: ``weight_bytes`` is what that format's tensors hold (for INT4 codes,
        scales and zero points), so a quantized run is measured against its own floor, not the 16-bit one.
    """
    _check_non_negative("weight_bytes", weight_bytes)
    _check_non_negative("kv_bytes_read", kv_bytes_read)
    _check_non_negative("flops", flops)
    _check_positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    _check_positive("measured_step_s", measured_step_s)
    mem = (weight_bytes + kv_bytes_read) / bandwidth_bytes_per_s
    comp = 0.0
    if peak_flops is not None:
        _check_positive("peak_flops", peak_flops)
        comp = flops / peak_flops
    floor = max(mem, comp)
    fraction = floor / measured_step_s
    of = (f" for {weights} weights, {weight_bytes / 1e9:.2f} GB of weights + {kv_bytes_read / 1e9:.2f} GB of KV read "
          f"per step") if weights else ""
    text = (f"decode step {measured_step_s * 1e3:.1f} ms, floor {floor * 1e3:.1f} ms{of} "
            f"({fraction * 100:.0f}% of floor)")
    return {"floor_s": floor, "measured_s": measured_step_s, "fraction_of_floor": fraction,
            "memory_floor_s": mem, "compute_floor_s": comp,
            "bound_by": "compute" if comp > mem else "memory", "text": text}
