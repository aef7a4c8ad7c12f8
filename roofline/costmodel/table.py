"""The readable text of a ``roofline cost`` artifact (:func:`roofline.costmodel.artifact.build_report`).
"""

from __future__ import annotations

from typing import Any

from roofline import costmodel as cm


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
    if "quantization" in r:
        lines += ["", *format_quantization(r["quantization"], hw["name"], hw["memory_bandwidth_bytes_per_s"])]
        lines += _format_vs_quantization(r)
    return "\n".join(lines)


def _format_vs_quantization(r: dict[str, Any]) -> list[str]:
    """Why a --quantization row's bound is not its format column's: the column counts every parameter at the
    format's bits per weight; the row counts the engine's bytes (16-bit LM head and norms, the embedding's rows
    only). One line per method whose format is a column."""
    from roofline.costmodel.formats import QUANTIZATION_FORMATS

    columns = {x["format"]: x for x in r["formats"]}
    n = r["model"]["num_params"]
    out = []
    for q in dict.fromkeys(row["quantization"] for row in r["quantization"]["rows"]):
        col = columns.get(QUANTIZATION_FORMATS.get(q, "bf16" if q == "none" else q))
        if col is None:
            continue
        rows = [x for x in r["quantization"]["rows"] if x["quantization"] == q]
        col_bytes, eng = col["weight_gb"] * 1e9, rows[0]["weight_bytes_per_step"]
        pairs = [(1, col["batch1_lower_bound_s"]), (r["workload"]["batch"], col["step_lower_bound_s"])]
        times = "; ".join(f"batch {b}: {_ms(t)} there, {_ms(x['bound_s'])} here" for b, t in dict(pairs).items()
                          for x in rows if x["batch"] == b)
        layout = "16-bit" if q == "none" else f"{q} codes + scales" + (" + zeros" if q == "int4" else "")
        out.append(f"  {q}: {eng / 1e9:.3f} GB/step of weights here = {rows[0]['projection_bytes'] / 1e9:.3f} GB of "
                   f"projections ({layout}) + {rows[0]['other_16bit_bytes'] / 1e9:.3f} GB in 16 bits (LM head, "
                   f"norms; the embedding's rows only); the {col['format']} column above counts "
                   f"{col['bits_per_weight']:g} bits x all {n / 1e9:.2f}e9 parameters = {col_bytes / 1e9:.3f} GB (LM "
                   f"head and embedding included at those bits), so its bounds are "
                   f"{'lower' if col_bytes < eng else 'higher'}" + (f" ({times})" if times else ""))
    if out:
        out.insert(0, "why the format columns above and these rows differ:")
    return out


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


def format_quantization(sec: dict[str, Any], hw_name: str, bandwidth: float) -> list[str]:
    """The readable lines of a :func:`build_quantization` artifact: bound beside predicted (measured kernels)."""
    lines = [f"per --quantization, one GPU, context {sec['context']}, KV {sec['kv_dtype']}: bound = the engine's bytes "
             f"per step (codes + scales + zeros; LM head, norms, embedding rows 16-bit) at {bandwidth / 1e12:.3f} TB/s "
             f"({hw_name})"]
    if sec["device"] is not None:
        lines.append(f"predicted (measured kernels) = each projection's dispatched kernel measured on the {sec['device']} "
                     "at M = batch + the rest of a measured bf16 step (step minus its projection kernels);")
        lines.append(f"  calibration: {sec['calibration']}")
    head = ["quantization", "batch", "weights GB/step", "bound", "predicted", "bound/predicted", "predicted tok/s",
            "qkv/o/gate_up/down us (kernel)"]
    body, notes = [], []
    for r in sec["rows"]:
        if r["predicted_s"] is None:
            pred = frac = tok = "-"
            kern = "bound only"
            notes.append(f"  {r['quantization']} batch {r['batch']}: bound only: {r['why_not_predicted']}")
        else:
            pred, frac = _ms(r["predicted_s"]), f"{r['fraction_of_floor']:.2f}"
            tok = f"{r['batch'] / r['predicted_s']:,.0f}"
            ks = r["kernels"].values()
            kern = "/".join(f"{k['us']:.1f}" for k in ks) + " (" + "/".join(
                dict.fromkeys(k["path"].split(" (")[0] for k in ks)) + ")"
        body.append([r["quantization"], str(r["batch"]), f"{r['weight_bytes_per_step'] / 1e9:.3f}",
                     f"{_ms(r['bound_s'])} {r['bound_by'][:3]}", pred, frac, tok, kern])
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]
    for row in [head, *body]:
        lines.append("  ".join(f"{v:>{w}}" if i < len(head) - 1 else v for i, (v, w) in enumerate(zip(row, widths,
                                                                                                      strict=True))))
    return lines + notes
