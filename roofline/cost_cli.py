"""``roofline cost`` and ``roofline probe``: the bound model from the command line.

``roofline cost`` prints, per weight format, the step-time lower bounds of Pope et al. 2022
("Efficiently Scaling Transformer Inference") and the speculative-decoding gain of Leviathan et al. 2023
("Fast Inference from Transformers via Speculative Decoding"); ``--json`` emits the full artifact and
``--plot`` draws it. ``roofline probe`` measures this machine and writes a hardware JSON that
``--hardware`` accepts. Every time printed is a lower bound, never a latency.

With ``--tp``/``--pp``/``--gpus``/``--best-layout`` it adds the parallel bound
(``roofline.costmodel.parallel_step``): per-GPU weights and KV under tensor x pipeline parallelism,
the decode step with its ring all-reduces and stage-to-stage sends over the links of
``roofline.hardware.INTERCONNECT_PRESETS``, and, with ``--best-layout``, every layout ranked by
batch-1 token time.

``roofline.cli`` registers both with :func:`add_cost_parser` and :func:`add_probe_parser`;
``python -m roofline.cost_cli {cost,probe} ...`` works on its own.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from roofline import costmodel as cm
from roofline.hardware import (
    HARDWARE_PRESETS,
    INTERCONNECT_PRESETS,
    HardwareSpec,
    load_hardware,
    load_interconnect,
)

ALPHA_SWEEP = tuple(round(0.05 * i, 2) for i in range(20))  # 0.00 .. 0.95
BATCH_SWEEP = tuple(2**i for i in range(11))  # 1 .. 1024
DEFAULTS = {"batch": 32, "context": 2048, "kv_dtype": "bf16", "alpha": 0.8, "gamma": 4, "draft_cost": 0.1}


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------

def resolve_model(spec: str) -> tuple[cm.ModelShape, dict[str, Any]]:
    """A model shape and its workload defaults from a fixture name, an engine preset
    (``roofline.config.MODEL_PRESETS``), an HF ``config.json`` or a directory holding one.

    Raises:
        ValueError: none of these (names the value and lists the presets).
    """
    from roofline.config import MODEL_PRESETS, ModelConfig, model_preset

    if spec in cm.FIXTURE_SHAPES:
        ws = cm.WORKSHEET
        return cm.FIXTURE_SHAPES[spec], {"batch": ws["batch"], "context": ws["context"],
                                         "kv_dtype": ws["kv_dtype"], "plain_step_s": ws["plain_step_s"]}
    if spec in MODEL_PRESETS:
        return cm.ModelShape.from_model_config(model_preset(spec)), {}
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read model config {str(path)!r}: {e}") from None
        try:
            model = ModelConfig.from_hf_config(cfg, name=path.parent.name or path.stem)
        except KeyError as e:
            raise ValueError(f"model config {str(path)!r} lacks key {e.args[0]!r}") from None
        return cm.ModelShape.from_model_config(model), {}
    known = ", ".join([*cm.FIXTURE_SHAPES, *sorted(MODEL_PRESETS)])
    raise ValueError(f"unknown model {spec!r}; known presets: {known}, or the path of an HF config.json "
                     "or of a directory holding one")


def _validate(args: argparse.Namespace) -> None:
    if args.batch is not None and args.batch < 1:
        raise ValueError(f"--batch must be an integer >= 1, got {args.batch}")
    if args.context is not None and args.context < 0:
        raise ValueError(f"--context must be an integer >= 0 tokens, got {args.context}")
    if not (0.0 <= args.alpha < 1.0):
        raise ValueError(f"--alpha must be in [0, 1), got {args.alpha}")
    if not (1 <= args.gamma <= 64):
        raise ValueError(f"--gamma must be an integer in [1, 64], got {args.gamma}")
    if not (args.draft_cost >= 0 and math.isfinite(args.draft_cost)):
        raise ValueError(f"--draft-cost must be a finite number >= 0, got {args.draft_cost}")
    if args.plain_step_ms is not None and not (args.plain_step_ms > 0 and math.isfinite(args.plain_step_ms)):
        raise ValueError(f"--plain-step-ms must be a finite number > 0, got {args.plain_step_ms}")
    if args.kv_dtype is not None:
        cm.kv_dtype_bytes(args.kv_dtype)
    for flag, value in (("--gpus", args.gpus), ("--gpus-per-node", args.gpus_per_node),
                        ("--micro-batches", args.micro_batches)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be an integer >= 1, got {value}")
    for flag, value in (("--interconnect", args.interconnect), ("--inter-node-interconnect", args.inter_node_interconnect)):
        if value not in INTERCONNECT_PRESETS:
            raise ValueError(f"unknown {flag} {value!r}; known: {', '.join(INTERCONNECT_PRESETS)}")
    for flag, value in (("--link-bandwidth", args.link_bandwidth), ("--inter-node-bandwidth", args.inter_node_bandwidth)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{flag} must be a finite number of GB/s > 0, got {value}")
    for flag, value in (("--link-latency-us", args.link_latency_us),
                        ("--inter-node-latency-us", args.inter_node_latency_us)):
        if value is not None and not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"{flag} must be a finite number of microseconds >= 0, got {value}")
    if args.best_layout and args.gpus is None:
        raise ValueError("--best-layout needs --gpus N (the GPUs to lay the model out on)")


def _wants_parallel(args: argparse.Namespace) -> bool:
    return args.best_layout or any(v is not None for v in (args.tp, args.pp, args.gpus))


def _validate_parallel(args: argparse.Namespace, shape: cm.ModelShape, batch: int) -> None:
    """Check ``--tp``/``--pp`` (1 when not given) against the model and ``--gpus``, and ``--micro-batches``."""
    tp = 1 if args.tp is None else args.tp
    pp = 1 if args.pp is None else args.pp
    cm.check_parallel_layout(shape, tp, pp, tp_name="--tp", pp_name="--pp")
    if args.gpus is not None and tp * pp > args.gpus:
        raise ValueError(f"--tp x --pp = {tp} x {pp} = {tp * pp} GPUs is more than --gpus {args.gpus}")
    if args.micro_batches > batch:
        raise ValueError(f"--micro-batches must be an integer in [1, --batch {batch}], got {args.micro_batches}")


# --------------------------------------------------------------------------------------------------
# The artifact
# --------------------------------------------------------------------------------------------------

def _format_row(shape: cm.ModelShape, hw: HardwareSpec, fmt: cm.WeightFormat, kv_seq: float, batch: int,
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


def build_report(shape: cm.ModelShape, hw: HardwareSpec, formats: list[str], kv_dtype: str, batch: int,
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


def build_sweep(kind: str, shape: cm.ModelShape, hw: HardwareSpec, fmts: list[cm.WeightFormat],
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


def build_parallel(shape: cm.ModelShape, hw: HardwareSpec, fmt: str, batch: int, context: int, kv_dtype: str,
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


# --------------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------------

def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _opt(v: Any, fmt: str) -> str:
    return "never" if v is None else format(v, fmt)


def format_table(r: dict[str, Any]) -> str:
    """The readable table of a :func:`build_report` artifact."""
    m, hw, wl, sp, rows = r["model"], r["hardware"], r["workload"], r["speculation"], r["formats"]
    b, g = wl["batch"], sp["gamma"]
    peak = hw["peak_flops"].get("bf16") or hw["peak_flops"].get("fp16")
    cap = hw["memory_capacity_bytes"]
    lines = [
        f"model     {m['name']}: {m['num_params'] / 1e9:.2f}e9 parameters, {m['num_layers']} layers, "
        f"{m['num_kv_heads']} KV heads x head_dim {m['head_dim']}",
        f"hardware  {hw['name']} ({hw['source']}): {hw['memory_bandwidth_bytes_per_s'] / 1e12:.3f} TB/s, "
        f"{peak / 1e12:.0f} TFLOP/s bf16 dense, "
        + (f"{cap / 1e9:.0f} GB" if cap else "capacity not stated")
        + f"; ridge {r['hardware_ratio_flop_per_byte']:.1f} FLOP/byte",
        f"workload  batch {b}, context {wl['context']}, KV {wl['kv_dtype']}: "
        f"{wl['kv_bytes_per_sequence']:,.0f} bytes per sequence, {wl['kv_bytes_batch'] / 1e9:.3f} GB for the batch",
        "All times are lower bounds (Pope et al. 2022), not latencies.",
        "",
    ]
    base = next(k for k in rows[0] if k.startswith("gain_vs_")).removeprefix("gain_vs_")
    table: list[tuple[str, list[str]]] = [
        ("format", [x["format"] for x in rows]),
        ("bits per weight", [f"{x['bits_per_weight']:g}" for x in rows]),
        ("weights (GB)", [f"{x['weight_gb']:.4f}" for x in rows]),
        ("weights (GiB)", [f"{x['weight_gib']:.2f}" for x in rows]),
        ("batch-1 lower bound, weights only", [_ms(x["batch1_weights_only_lower_bound_s"]) for x in rows]),
        (f"batch-1 lower bound, KV at {wl['context']}", [_ms(x["batch1_lower_bound_s"]) for x in rows]),
        (f"batch-{b} lower bound", [_ms(x["step_lower_bound_s"]) for x in rows]),
        (f"batch-{b} bound by", [x["step"]["bound_by"] for x in rows]),
        (f"batch-{b} intensity (FLOP/byte)", [f"{x['step']['arithmetic_intensity']:.1f}" for x in rows]),
        (f"gain vs {base} at batch {b}", [f"{x['gain_vs_' + base]:.2f}x" for x in rows]),
        (f"bit ratio vs {base}", [f"{x['bit_ratio_vs_' + base]:.2f}x" for x in rows]),
        (f"verify lower bound ({g + 1} positions)", [_ms(x["verify_step"]["step_lower_bound_s"]) for x in rows]),
        ("verify cost ratio", [f"{x['verify_cost_ratio']:.4f}" for x in rows]),
        (f"speculative speedup at batch {b}", [f"{x['speculative_speedup_at_batch']:.4f}" for x in rows]),
        ("break-even alpha at batch", [_opt(x["break_even_alpha_at_batch"], ".4f") for x in rows]),
        ("best gamma at batch (speedup)",
         [f"{x['best_gamma_at_batch']['gamma']} ({x['best_gamma_at_batch']['speedup']:.4f})" for x in rows]),
        ("compute-bound from batch (decode)", [_opt(x["min_compute_bound_batch_decode"], "d") for x in rows]),
        (f"compute-bound from batch (verify {g + 1})",
         [_opt(x["min_compute_bound_batch_verify"], "d") for x in rows]),
        (f"fits at batch {b} (10% reserve)",
         ["n/a" if x["fits"] is None else f"{'yes' if x['fits']['fits'] else 'no'} (max {x['fits']['max_batch']})"
          for x in rows]),
    ]
    w0 = max(len(k) for k, _ in table)
    w1 = max(12, *(len(v) for _, vs in table for v in vs))
    for k, vs in table:
        lines.append(f"{k:<{w0}}  " + "  ".join(f"{v:>{w1}}" for v in vs).rstrip())
    lines += [
        "",
        f"speculation (Leviathan et al. 2023): alpha {sp['alpha']}, gamma {g}, draft cost c {sp['draft_cost']}, "
        f"plain step {sp['plain_step_s'] * 1e3:.3f} ms ({sp['plain_step_source']})",
        f"  E[tokens per target step]          {sp['expected_tokens_per_step']:.4f}",
        f"  speedup with free verification     {sp['speedup_free_verification']:.4f}x",
        f"  iteration lower bound              {sp['iteration_lower_bound_s'] * 1e3:.4f} ms",
        f"  average TPOT lower bound           {sp['average_tpot_lower_bound_s'] * 1e3:.4f} ms",
        f"  break-even alpha                   {_opt(sp['break_even_alpha'], '.4f')}",
        f"  {'best gamma in 1..' + str(cm.MAX_GAMMA):<35}{sp['best_gamma']['gamma']} "
        f"({sp['best_gamma']['speedup']:.4f}x)",
    ]
    if "sweep" in r:
        lines += ["", *format_sweep(r["sweep"])]
    if "parallel" in r:
        lines += ["", *format_parallel(r["parallel"])]
    return "\n".join(lines)


def format_sweep(sw: dict[str, Any]) -> list[str]:
    rows = sw["rows"]
    kind = sw["kind"]
    if kind == "alpha":
        names = list(rows[0]["speedup_at_batch"])
        head = ["alpha", "E[tokens]", "free verify"] + [f"{n} at batch" for n in names]
        body = [[f"{x['alpha']:.2f}", f"{x['expected_tokens_per_step']:.4f}", f"{x['speedup_free_verification']:.4f}"]
                + [f"{x['speedup_at_batch'][n]:.4f}" for n in names] for x in rows]
    elif kind == "gamma":
        names = list(rows[0]["speedup_at_batch"])
        head = ["gamma", "E[tokens]", "free verify"] + [f"{n} ratio/speedup" for n in names]
        body = [[str(x["gamma"]), f"{x['expected_tokens_per_step']:.4f}", f"{x['speedup_free_verification']:.4f}"]
                + [f"{x['verify_cost_ratio'][n]:.4f}/{x['speedup_at_batch'][n]:.4f}" for n in names] for x in rows]
    else:
        names = list(rows[0]["step_lower_bound_s"])
        head = ["batch"] + [f"{n} lower bound" for n in names]
        body = [[str(x["batch"])] + [f"{_ms(x['step_lower_bound_s'][n])} {x['bound_by'][n][:3]}" for n in names]
                for x in rows]
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]
    out = [f"sweep over {kind}" + (" (times are lower bounds)" if kind == "batch" else "")]
    for row in [head, *body]:
        out.append("  ".join(f"{v:>{w}}" for v, w in zip(row, widths, strict=True)))
    return out


def _us(s: float) -> str:
    return f"{s * 1e6:.2f} us"


def _fits_text(f: dict[str, Any] | None) -> str:
    if f is None:
        return "n/a"
    return f"{'yes' if f['fits'] else 'no'} (max {_max_batch(f['max_batch'])})"


def _max_batch(n: int) -> str:
    return "any" if n < 0 else str(n)  # -1: no KV to hold (context 0)


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]
    return ["  ".join(f"{v:>{w}}" for v, w in zip(row, widths, strict=True)) for row in [head, *body]]


def format_parallel(par: dict[str, Any]) -> list[str]:
    """The readable lines of a :func:`build_parallel` artifact."""
    lay, links, b = par["layout"], par["links"], par["batch"]
    tok, at = lay["token"], lay["at_batch"]

    def link_text(x: dict[str, Any]) -> str:
        return f"{x['name']} {x['bandwidth_bytes_per_s'] / 1e9:g} GB/s, {x['latency_per_step_s'] * 1e6:g} us per ring step"

    lines = [
        f"parallelism  {par['format']} weights, batch {b}, context {par['context']}, KV {par['kv_dtype']}, "
        f"{par['gpus_per_node']} GPUs per node",
        f"links        inside a node {link_text(links['intra_node'])}; between nodes {link_text(links['inter_node'])}",
        "Memory and compute are lower bounds (Pope et al. 2022); all-reduces (2 per layer, Megatron-LM) and "
        "stage sends are ring alpha-beta estimates (Thakur et al. 2005) on their group's slowest link.",
    ]
    if "best_layouts" in par:
        lines += ["", f"layouts on at most {par['num_gpus']} GPUs, ranked by batch-1 token time "
                      f"(those that do not fit at batch {b} last)"]
        body = []
        rank = 0
        for x in par["best_layouts"]:
            rank += 1 if x["fits"] is not False else 0
            body.append([str(rank) if x["fits"] is not False else "-", f"{x['tp']} x {x['pp']}", str(x["num_gpus"]),
                         x["tp_link"] if x["tp"] > 1 else "-", f"{x['max_weight_bytes_per_gpu'] / 1e9:.3f}",
                         "n/a" if x["fits"] is None else f"{'yes' if x['fits'] else 'no'} ({_max_batch(x['max_batch'])})",
                         _ms(x["token_s"]), _ms(x["token_communication_s"]), f"{x['tokens_per_s_at_batch']:,.0f}"])
        lines += _table(["rank", "TP x PP", "GPUs", "TP link", "weights/GPU (GB)", f"fits at {b} (max)",
                         "batch-1 token", "of it comm", f"batch-{b} tok/s"], body)
    lines += ["", f"layout TP {lay['tp']} x PP {lay['pp']} = {lay['tp'] * lay['pp']} GPUs, per GPU, batch 1:"]
    body = [[str(st["stage"]), str(st["num_layers"]), st["tp_link"] if lay["tp"] > 1 else "-",
             str(st["kv_heads_per_gpu"]), f"{st['weight_bytes_per_gpu'] / 1e9:.3f}",
             f"{st['kv_bytes_per_sequence_per_gpu'] / 1e6:.2f}", _ms(st["memory_lower_bound_s"]),
             _ms(st["compute_lower_bound_s"]), f"{_us(st['allreduce_s'])} x {st['num_allreduces']}",
             _ms(st["stage_s"])] for st in tok["stages"]]
    lines += _table(["stage", "layers", "TP link", "KV heads/GPU", "weights/GPU (GB)", "KV/GPU/seq (MB)",
                     "memory", "compute", "all-reduce x n", "stage"], body)
    comm_share = tok["communication_s"] / tok["step_s"]
    sends = f", {lay['pp'] - 1} stage sends {_us(sum(tok['send_s']))}" if lay["pp"] > 1 else ""
    fits = _fits_text(at["fits"]) + ("" if at["fits"] is None else f": {at['fits']['needed_bytes'] / 1e9:.2f} GB "
                                     f"of {at['fits']['capacity_bytes'] / 1e9:.0f} GB on the fullest GPU (10% reserve)")
    rows = [
        ("batch-1 token", f"{_ms(tok['step_s'])} ({_ms(tok['communication_s'])} communication, {comm_share:.0%}"
                          f"{sends}): {tok['tokens_per_s']:,.0f} tok/s"),
        (f"batch-{b} step", f"{_ms(at['step_s'])} in {at['num_micro_batches']} micro-batch(es) of "
                            f"{at['stages'][0]['micro_batch']}, pipeline utilization {at['pipeline_utilization']:.2f} "
                            f"(GPipe m/(m+p-1)): {at['tokens_per_s']:,.0f} tok/s"),
        (f"fits at batch {b}", fits),
    ]
    if b == 1:
        del rows[1]  # the batch-1 step is the token line
    w = max(len(k) for k, _ in rows)
    return lines + [f"  {k:<{w}}  {v}" for k, v in rows]


# --------------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------------

def write_plot(path: str | Path, shape: cm.ModelShape, hw: HardwareSpec, formats: list[str], kv_dtype: str,
               context: int, batch: int, gamma: int, draft_cost: float) -> None:
    """Two panels: step lower bound vs batch per format (decode solid, verify of ``gamma + 1`` dashed,
    memory/compute crossover marked), and speculative speedup vs alpha per gamma (free verification)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, bw, peak = shape.num_params, hw.memory_bandwidth, hw.peak("bf16")
    kv_seq = shape.kv_bytes_per_sequence(context, kv_dtype)
    batches = sorted({*range(1, 16), *(int(round(2 ** (i / 4))) for i in range(4, 45)), batch})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    never: list[str] = []
    for i, f in enumerate(cm.parse_weight_format(x) for x in formats):
        col = colors[i % len(colors)]
        w = cm.weight_bytes(p, f)
        for pos, style, label in ((1, "-", f"{f.name} decode"), (gamma + 1, "--", f"{f.name} verify {gamma + 1}")):
            ys = [cm.step_bound(p, w, kv_seq, b, bw, peak, pos).bound_s * 1e3 for b in batches]
            ax1.plot(batches, ys, style, color=col, label=label)
            cross = cm.min_compute_bound_batch(p, w, kv_seq, bw, peak, pos)
            if cross is not None and cross <= batches[-1]:
                y = cm.step_bound(p, w, kv_seq, cross, bw, peak, pos).bound_s * 1e3
                ax1.plot([cross], [y], "o", color=col, markersize=7)
                ax1.annotate(f"compute-bound\nfrom b={cross}", (cross, y), textcoords="offset points",
                             xytext=(6, -22), fontsize=7, color=col)
        if cm.min_compute_bound_batch(p, w, kv_seq, bw, peak, 1) is None:
            never.append(f.name)
    if never:
        ax1.text(0.02, 0.70, f"decode (1 position) never compute-bound for {', '.join(never)}:\n"
                 "KV bytes per sequence outgrow its FLOPs", transform=ax1.transAxes, ha="left",
                 va="top", fontsize=7)
    ax1.axvline(batch, color="grey", linewidth=0.8, linestyle=":")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("batch (sequences)")
    ax1.set_ylabel("step time lower bound (ms)")
    ax1.set_title(f"{shape.name} on {hw.name}: step lower bound\n(context {context}, KV {kv_dtype}; "
                  "dots mark memory/compute crossover)", fontsize=9)
    ax1.legend(fontsize=7)
    ax1.grid(True, which="both", alpha=0.3)

    alphas = [i / 200 for i in range(0, 199)]
    for g in range(1, cm.MAX_GAMMA + 1):
        ax2.plot(alphas, [cm.speculative_speedup(a, g, draft_cost) for a in alphas], label=f"gamma {g}")
    ax2.axhline(1.0, color="black", linewidth=0.8)
    ax2.set_xlabel("acceptance rate alpha")
    ax2.set_ylabel("speedup over plain decoding")
    ax2.set_title(f"speculative speedup, free verification, c={draft_cost}\n(Leviathan et al. 2023)", fontsize=9)
    ax2.legend(fontsize=7, ncol=2)
    ax2.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# Handlers
# --------------------------------------------------------------------------------------------------

def _error(cmd: str, msg: str) -> int:
    print(f"roofline {cmd}: error: {msg}", file=sys.stderr)
    return 2


def run_cost(args: argparse.Namespace) -> int:
    """Handler of ``roofline cost``; returns 0, or 2 after printing what was wrong."""
    try:
        _validate(args)
        shape, defaults = resolve_model(args.model)
        hw = load_hardware(args.hardware)
        hw.peak("bf16")
        formats = args.format or list(cm.DEFAULT_FORMATS)
        for f in formats:
            cm.parse_weight_format(f)
        batch = args.batch if args.batch is not None else defaults.get("batch", DEFAULTS["batch"])
        context = args.context if args.context is not None else defaults.get("context", DEFAULTS["context"])
        kv_dtype = args.kv_dtype or defaults.get("kv_dtype", DEFAULTS["kv_dtype"])
        plain = args.plain_step_ms / 1e3 if args.plain_step_ms is not None else defaults.get("plain_step_s")
        source = "given" if args.plain_step_ms is not None else "the worksheet's assumption"
        report = build_report(shape, hw, formats, kv_dtype, batch, context, args.alpha, args.gamma,
                              args.draft_cost, plain, args.sweep, plain_step_source=source)
        if _wants_parallel(args):
            _validate_parallel(args, shape, batch)
            intra = load_interconnect(args.interconnect, args.link_bandwidth, args.link_latency_us)
            inter = load_interconnect(args.inter_node_interconnect, args.inter_node_bandwidth,
                                      args.inter_node_latency_us)
            report["parallel"] = build_parallel(shape, hw, formats[0], batch, context, kv_dtype, args.tp, args.pp,
                                                args.gpus, args.gpus_per_node, intra, inter, args.micro_batches,
                                                args.best_layout)
    except ValueError as e:
        return _error("cost", str(e))
    if args.plot:
        try:
            write_plot(args.plot, shape, hw, formats, kv_dtype, context, batch, args.gamma, args.draft_cost)
        except OSError as e:
            return _error("cost", f"cannot write plot {args.plot!r}: {e}")
        report["plot"] = str(args.plot)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


def run_probe(args: argparse.Namespace) -> int:
    """Handler of ``roofline probe``: measure, print a summary, write the hardware JSON."""
    from roofline.hardware import probe

    try:
        spec = probe(device=args.device, rounds=args.rounds,
                     size_bytes=int(args.size_mb * 2**20) if args.size_mb is not None else None,
                     gemm_n=args.gemm_n)
    except ValueError as e:
        return _error("probe", str(e))
    d = spec.details
    print(f"{d['device_name']}  ({d['device']}, median of {d['rounds']} rounds after a warm-up)")
    print(f"  read  {d['read_bytes_per_s'] / 1e9:10.2f} GB/s over {d['buffer_bytes'] / 2**20:.0f} MiB")
    print(f"  copy  {d['copy_bytes_per_s'] / 1e9:10.2f} GB/s (read + write bytes)")
    for dtype, note in d["gemm"].items():
        rate = spec.peak_flops.get(dtype)
        print(f"  gemm {dtype:<5}" + (f"{rate / 1e12:10.3f} TFLOP/s (n={d['gemm_n']})" if rate
                                       else f"  unsupported: {note['unsupported']}"))
    if args.output:
        try:
            spec.save(args.output)
        except OSError as e:
            return _error("probe", f"cannot write {args.output!r}: {e}")
        print(f"wrote {args.output}; use it with `roofline cost --hardware {args.output}`")
    else:
        print(json.dumps(spec.to_dict(), indent=2))
    return 0


def add_cost_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``cost`` to an argparse subparsers object (``func`` = :func:`run_cost`)."""
    p = subparsers.add_parser(
        "cost", help="step-time lower bounds and speculative gain per weight format",
        description=__doc__.split("\n\n")[1], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="dense-70b-fixture-r1",
                   help="fixture or engine preset name, HF config.json, or a directory holding one")
    p.add_argument("--hardware", default="h200",
                   help=f"preset ({', '.join(HARDWARE_PRESETS)}) or a JSON file from `roofline probe`")
    p.add_argument("--format", action="append", default=None,
                   help=f"weight format, repeatable (default {' '.join(cm.DEFAULT_FORMATS)}); also int4_g64 "
                        "or bits per weight")
    p.add_argument("--kv-dtype", default=None,
                   help=f"KV cache dtype ({', '.join(cm.KV_DTYPE_BYTES)}); default bf16. int8 also counts its "
                        "float32 scale per token and KV head, as the engine's pool does")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 32)")
    p.add_argument("--context", type=int, default=None, help="tokens of KV per sequence (default 2048)")
    p.add_argument("--alpha", type=float, default=DEFAULTS["alpha"], help="acceptance rate in [0, 1)")
    p.add_argument("--gamma", type=int, default=DEFAULTS["gamma"], help="draft tokens per step")
    p.add_argument("--draft-cost", type=float, default=DEFAULTS["draft_cost"],
                   help="draft step time / target step time (c)")
    p.add_argument("--plain-step-ms", type=float, default=None,
                   help="plain target step in ms (default: the fixture's 25 ms, else the first format's bound)")
    p.add_argument("--sweep", choices=("alpha", "gamma", "batch"), default=None)
    p.add_argument("--json", action="store_true", help="print the full JSON artifact")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write the two-panel plot")
    links = ", ".join(INTERCONNECT_PRESETS)
    par = p.add_argument_group("parallelism", "tensor x pipeline parallel bound, for the first --format")
    par.add_argument("--tp", type=int, default=None, help="tensor-parallel size; must divide the attention heads "
                     "(default 1)")
    par.add_argument("--pp", type=int, default=None, help="pipeline-parallel stages, in [1, layers] (default 1)")
    par.add_argument("--gpus", type=int, default=None, help="GPUs available; --best-layout searches tp x pp <= this")
    par.add_argument("--gpus-per-node", type=int, default=8,
                     help="GPUs per node; a TP group or stage boundary crossing nodes uses the inter-node link")
    par.add_argument("--interconnect", default="nvlink", help=f"link between GPUs of a node ({links})")
    par.add_argument("--inter-node-interconnect", default="ib", help=f"link between nodes ({links})")
    par.add_argument("--link-bandwidth", type=float, default=None, metavar="GB/s",
                     help="override --interconnect's bandwidth per direction per GPU")
    par.add_argument("--link-latency-us", type=float, default=None, metavar="US",
                     help="override --interconnect's latency per ring step")
    par.add_argument("--inter-node-bandwidth", type=float, default=None, metavar="GB/s",
                     help="override --inter-node-interconnect's bandwidth per direction per GPU")
    par.add_argument("--inter-node-latency-us", type=float, default=None, metavar="US",
                     help="override --inter-node-interconnect's latency per ring step")
    par.add_argument("--micro-batches", type=int, default=1,
                     help="pipeline micro-batches at --batch (GPipe schedule, flushed every step)")
    par.add_argument("--best-layout", action="store_true",
                     help="rank every TP x PP layout on at most --gpus GPUs by batch-1 token time")
    p.set_defaults(func=run_cost)
    return p


def add_probe_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``probe`` to an argparse subparsers object (``func`` = :func:`run_probe`)."""
    p = subparsers.add_parser("probe", help="measure this device's bandwidth and GEMM rates",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up); median reported")
    p.add_argument("--size-mb", type=float, default=None, help="bandwidth buffer in MiB (default 256 CPU, 1024 CUDA)")
    p.add_argument("--gemm-n", type=int, default=None, help="GEMM size n (default 512 CPU, 8192 CUDA)")
    p.add_argument("--output", default=None, metavar="FILE.json", help="write the hardware JSON here")
    p.set_defaults(func=run_probe)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="roofline")
    sub = parser.add_subparsers(dest="command", required=True)
    add_cost_parser(sub)
    add_probe_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
