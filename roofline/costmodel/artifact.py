"""The ``roofline cost`` artifact (what ``--json`` prints): per-format bounds, speculation, sweeps and the
parallel layout. Times in seconds, all lower bounds.
"""

from __future__ import annotations

from typing import Any, Protocol

from roofline import costmodel as cm


class Device(Protocol):
    """What the artifact reads of a device; ``roofline.hardware.HardwareSpec`` is one (the bound model does
    not import ``roofline.hardware``, which sits above it)."""

    @property
    def name(self) -> str: ...

    @property
    def memory_bandwidth(self) -> float:
        """Read bandwidth, bytes/s."""
        ...

    @property
    def memory_capacity(self) -> float | None:
        """Device memory in bytes, or None when unknown."""
        ...

    def peak(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s for ``dtype``."""
        ...

    def to_dict(self) -> dict[str, Any]: ...

ALPHA_SWEEP = tuple(round(0.05 * i, 2) for i in range(20))  # 0.00 .. 0.95
BATCH_SWEEP = tuple(2**i for i in range(11))  # 1 .. 1024


def _format_row(shape: cm.ModelShape, hw: Device, fmt: cm.WeightFormat, kv_seq: float, batch: int,
                context: int, alpha: float, gamma: int, c: float) -> dict[str, Any]:
    p, bw, peak = shape.num_params, hw.memory_bandwidth, hw.peak("bf16")
    w = cm.weight_bytes(p, fmt)
    at_batch = cm.step_bound(p, w, kv_seq, batch, bw, peak)
    verify = cm.step_bound(p, w, kv_seq, batch, bw, peak, positions=gamma + 1)
    ratio = verify.bound_s / at_batch.bound_s

    def ratio_for(g: int) -> float:
        return cm.verify_cost_ratio(p, w, kv_seq, batch, bw, peak, g)

    g_best, s_best = cm.best_gamma(alpha, c, ratio_for)
    row: dict[str, Any] = {
        "format": fmt.name, "bits_per_weight": fmt.bits_per_weight, "weight_bytes": w,
        "weight_gb": w / cm.GB, "weight_gib": w / cm.GIB,
        "batch1_weights_only_lower_bound_s": cm.step_bound(p, w, 0.0, 1, bw, peak).bound_s,
        "batch1_lower_bound_s": cm.step_bound(p, w, kv_seq, 1, bw, peak).bound_s,
        "step_lower_bound_s": at_batch.bound_s,
        "step": at_batch.as_dict(),
        "verify_step": verify.as_dict(),
        "verify_cost_ratio": ratio,
        "speculative_speedup_at_batch": cm.speculative_speedup(alpha, gamma, c, ratio),
        "break_even_alpha_at_batch": cm.break_even_alpha(gamma, c, ratio),
        "best_gamma_at_batch": {"gamma": g_best, "speedup": s_best},
        "min_compute_bound_batch_decode": cm.min_compute_bound_batch(p, w, kv_seq, bw, peak, 1),
        "min_compute_bound_batch_verify": cm.min_compute_bound_batch(p, w, kv_seq, bw, peak, gamma + 1),
        "fits": None,
    }
    if hw.memory_capacity is not None:
        row["fits"] = cm.fits_on_device(w, kv_seq, batch, hw.memory_capacity)
    return row


def build_report(shape: cm.ModelShape, hw: Device, formats: list[str], kv_dtype: str, batch: int,
                 context: int, alpha: float, gamma: int, draft_cost: float, plain_step_s: float | None,
                 sweep: str | None = None, plain_step_source: str = "given") -> dict[str, Any]:
    """The full ``roofline cost`` artifact (what ``--json`` prints). Times in seconds, all lower bounds.

    ``plain_step_s`` (one plain target step, for iteration time and TPOT) defaults to the first
    format's step lower bound at ``batch``.
    """
    fmts = [cm.parse_weight_format(f) for f in formats]
    kv_seq = shape.kv_bytes_per_sequence(context, kv_dtype)
    rows = [_format_row(shape, hw, f, kv_seq, batch, context, alpha, gamma, draft_cost) for f in fmts]
    base = next((r for r in rows if r["format"] == "bf16"), rows[0])
    for r in rows:
        r["gain_vs_" + base["format"]] = base["step_lower_bound_s"] / r["step_lower_bound_s"]
        r["bit_ratio_vs_" + base["format"]] = base["bits_per_weight"] / r["bits_per_weight"]
    plain_source = plain_step_source
    if plain_step_s is None:
        plain_step_s, plain_source = rows[0]["step_lower_bound_s"], f"{rows[0]['format']} step lower bound"
    e = cm.expected_tokens_per_step(alpha, gamma)
    report: dict[str, Any] = {
        "citations": [cm.PAPER_POPE, cm.PAPER_LEVIATHAN],
        "note": "every time (keys ending in _s) is a lower bound in seconds",
        "model": {"name": shape.name, "num_params": shape.num_params, "num_layers": shape.num_layers,
                  "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
                  "hidden_size": shape.hidden_size},
        "hardware": hw.to_dict(),
        "compute_dtype": "bf16",
        "hardware_ratio_flop_per_byte": cm.hardware_ratio(hw.peak("bf16"), hw.memory_bandwidth),
        "workload": {"batch": batch, "context": context, "kv_dtype": kv_dtype,
                     "kv_bytes_per_sequence": kv_seq, "kv_bytes_batch": batch * kv_seq},
        "formats": rows,
        "speculation": {
            "alpha": alpha, "gamma": gamma, "draft_cost": draft_cost,
            "plain_step_s": plain_step_s, "plain_step_source": plain_source,
            "expected_tokens_per_step": e,
            "speedup_free_verification": cm.speculative_speedup(alpha, gamma, draft_cost),
            "iteration_lower_bound_s": cm.iteration_time(plain_step_s, gamma, draft_cost),
            "average_tpot_lower_bound_s": cm.average_tpot(plain_step_s, alpha, gamma, draft_cost),
            "break_even_alpha": cm.break_even_alpha(gamma, draft_cost),
            "best_gamma": dict(zip(("gamma", "speedup"), cm.best_gamma(alpha, draft_cost), strict=True)),
        },
    }
    if sweep is not None:
        report["sweep"] = build_sweep(sweep, shape, hw, fmts, kv_seq, batch, alpha, gamma, draft_cost)
    return report


def build_sweep(kind: str, shape: cm.ModelShape, hw: Device, fmts: list[cm.WeightFormat],
                kv_seq: float, batch: int, alpha: float, gamma: int, c: float) -> dict[str, Any]:
    """Rows of a sweep over ``alpha`` (0..0.95), ``gamma`` (1..8) or ``batch`` (1..1024)."""
    p, bw, peak = shape.num_params, hw.memory_bandwidth, hw.peak("bf16")
    ws = {f.name: cm.weight_bytes(p, f) for f in fmts}
    rows: list[dict[str, Any]] = []
    if kind == "alpha":
        ratios = {n: cm.verify_cost_ratio(p, w, kv_seq, batch, bw, peak, gamma) for n, w in ws.items()}
        for a in ALPHA_SWEEP:
            rows.append({"alpha": a, "expected_tokens_per_step": cm.expected_tokens_per_step(a, gamma),
                         "speedup_free_verification": cm.speculative_speedup(a, gamma, c),
                         "speedup_at_batch": {n: cm.speculative_speedup(a, gamma, c, r)
                                              for n, r in ratios.items()}})
    elif kind == "gamma":
        for g in range(1, cm.MAX_GAMMA + 1):
            ratios = {n: cm.verify_cost_ratio(p, w, kv_seq, batch, bw, peak, g) for n, w in ws.items()}
            rows.append({"gamma": g, "expected_tokens_per_step": cm.expected_tokens_per_step(alpha, g),
                         "speedup_free_verification": cm.speculative_speedup(alpha, g, c),
                         "verify_cost_ratio": ratios,
                         "speedup_at_batch": {n: cm.speculative_speedup(alpha, g, c, r)
                                              for n, r in ratios.items()}})
    elif kind == "batch":
        for b in sorted({*BATCH_SWEEP, batch}):
            entry: dict[str, Any] = {"batch": b, "step_lower_bound_s": {}, "bound_by": {},
                                     "verify_cost_ratio": {}, "fits": {}}
            for n, w in ws.items():
                sb = cm.step_bound(p, w, kv_seq, b, bw, peak)
                entry["step_lower_bound_s"][n] = sb.bound_s
                entry["bound_by"][n] = sb.bound_by
                entry["verify_cost_ratio"][n] = cm.verify_cost_ratio(p, w, kv_seq, b, bw, peak, gamma)
                entry["fits"][n] = (None if hw.memory_capacity is None
                                    else cm.fits_on_device(w, kv_seq, b, hw.memory_capacity)["fits"])
            rows.append(entry)
    else:
        raise ValueError(f"--sweep must be one of alpha, gamma, batch; got {kind!r}")
    return {"kind": kind, "rows": rows}


def _link_dict(link: cm.Link) -> dict[str, Any]:
    return {"name": link.name, "bandwidth_bytes_per_s": link.bandwidth, "latency_per_step_s": link.latency_s,
            "citation": link.citation}


def build_parallel(shape: cm.ModelShape, hw: Device, fmt: str, batch: int, context: int, kv_dtype: str,
                   tp: int | None, pp: int | None, num_gpus: int | None, gpus_per_node: int, intra: cm.Link,
                   inter: cm.Link, num_micro_batches: int = 1, best: bool = False) -> dict[str, Any]:
    """The ``parallel`` part of the artifact: the layout ``tp x pp`` (1 x 1 when not given; the best
    fitting one under ``best`` when neither is given) at batch 1 and at ``batch``, and with ``best``
    every layout on at most ``num_gpus`` GPUs ranked by :func:`roofline.costmodel.best_layouts`."""
    common: dict[str, Any] = dict(bandwidth=hw.memory_bandwidth, peak_flops=hw.peak("bf16"), intra=intra,
                                  inter=inter, gpus_per_node=gpus_per_node, fmt=fmt, context=context,
                                  kv_dtype=kv_dtype, capacity_bytes=hw.memory_capacity)
    out: dict[str, Any] = {
        "note": "memory and compute terms are lower bounds (Pope et al. 2022); all-reduces and sends follow the "
                "ring alpha-beta model (Thakur et al. 2005) on the slowest link of their group",
        "citations": [cm.PAPER_POPE, cm.PAPER_MEGATRON, cm.PAPER_THAKUR, cm.PAPER_GPIPE],
        "format": cm.parse_weight_format(fmt).name, "batch": batch, "context": context, "kv_dtype": kv_dtype,
        "num_gpus": num_gpus, "gpus_per_node": gpus_per_node,
        "links": {"intra_node": _link_dict(intra), "inter_node": _link_dict(inter)},
    }
    ranked: list[tuple[cm.ParallelBound, cm.ParallelBound]] = []
    if best:
        if num_gpus is None:
            raise ValueError("the layout search needs num_gpus")
        ranked = cm.best_layouts(shape, num_gpus, batch, num_micro_batches=num_micro_batches, **common)
        out["best_layouts"] = [
            {"tp": t.tp, "pp": t.pp, "num_gpus": t.num_gpus, "tp_link": t.stages[0].link.name,
             "max_weight_bytes_per_gpu": max(s.shard.weight_bytes for s in t.stages),
             "fits": None if b.fits is None else b.fits["fits"],
             "max_batch": None if b.fits is None else b.fits["max_batch"],
             "token_s": t.step_s, "token_communication_s": t.comm_s,
             "step_s_at_batch": b.step_s, "tokens_per_s_at_batch": b.tokens_per_s,
             "pipeline_utilization_at_batch": b.utilization}
            for t, b in ranked]
    if best and tp is None and pp is None:
        tp, pp = ranked[0][0].tp, ranked[0][0].pp
    tp, pp = tp or 1, pp or 1
    token = cm.parallel_step(shape, tp, pp, 1, **common)
    at_batch = cm.parallel_step(shape, tp, pp, batch, num_micro_batches=num_micro_batches, **common)
    out["layout"] = {"tp": tp, "pp": pp, "token": token.as_dict(), "at_batch": at_batch.as_dict()}
    return out


def build_quantization(shape: cm.ModelShape, hw: Device, quantizations: list[str], batches: list[int],
                       context: int, kv_dtype: str) -> dict[str, Any]:
    """The ``quantization`` part of the artifact: per ``--quantization`` and batch, the bound from the engine's
    bytes per step (:func:`roofline.costmodel.measured.quantized_weight_bytes_per_step`) and, where the device
    has a measured kernel table, the predicted step from measured kernels
    (:func:`roofline.costmodel.measured.predict_decode_step`), or the reason there is none. Seconds.

    Raises:
        ValueError: an unknown quantization, or a model without projection shapes (names the model).
    """
    from roofline.costmodel import measured as ms

    table = ms.measured_table(hw.name)
    kv_seq = shape.kv_bytes_per_sequence(context, kv_dtype)
    rows = []
    for q in quantizations:
        projections, other = ms.weight_bytes_split(shape, q)
        w = projections + other
        for b in batches:
            sb = cm.step_bound(shape.num_params, w, kv_seq, b, hw.memory_bandwidth, hw.peak("bf16"))
            row: dict[str, Any] = {"quantization": q, "batch": b, "weight_bytes_per_step": w,
                                   "projection_bytes": projections, "other_16bit_bytes": other, "bound_s": sb.bound_s,
                                   "bound_by": sb.bound_by, "predicted_s": None, "fraction_of_floor": None,
                                   "why_not_predicted": ms.why_not_predicted(table, shape, q, b)}
            if row["why_not_predicted"] is None:
                p = ms.predict_decode_step(table, shape, q, b, context, kv_seq)  # type: ignore[arg-type]
                row.update(predicted_s=p["predicted_s"], fraction_of_floor=sb.bound_s / p["predicted_s"],
                           projections_s=p["projections_s"], rest_s=p["rest_s"], kernels=p["kernels"])
            rows.append(row)
    return {
        "note": "bound: the engine's weight bytes per step (codes + scales + zero points; LM head, norms and the "
                "embedding rows in 16 bits) + KV, over the device bandwidth (Pope et al. 2022); predicted: each "
                "projection's dispatched kernel measured on the device at M = batch, plus the rest of a measured "
                "bf16 decode step (its step minus its projection kernels)",
        "device": None if table is None else table["device"],
        "calibration": None if table is None else table["calibration"]["source"],
        "context": context, "kv_dtype": kv_dtype, "rows": rows,
    }
