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
``python -m roofline.cost_cli {cost,probe} ...`` works on its own. The artifact is built in
:mod:`roofline.costmodel.artifact`, printed by :mod:`roofline.costmodel.table` and drawn by
:mod:`roofline.costmodel.plot`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from roofline import costmodel as cm
from roofline.costmodel.artifact import build_parallel, build_quantization, build_report
from roofline.costmodel.plot import write_plot
from roofline.costmodel.table import format_table
from roofline.hardware import HARDWARE_PRESETS, INTERCONNECT_PRESETS, load_hardware, load_interconnect

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


def _batch_list(text: str) -> list[int]:
    """``--batch``: one size or a comma-separated list (``1,8,64``)."""
    try:
        return [int(v) for v in str(text).split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch takes integers separated by commas, got {text!r}") from None


def _quantizations(text: str | None) -> list[str]:
    """``--quantization``: one vLLM method or a comma-separated list (``none,int4``); a repeated name counts once.

    Raises:
        ValueError: an unknown method (lists the known ones).
    """
    from roofline.costmodel.measured import ENGINE_QUANTIZATIONS

    if text is None:
        return []
    names = [v.strip() for v in str(text).split(",") if v.strip()]
    for q in names:
        if q not in ENGINE_QUANTIZATIONS:
            raise ValueError(f"unknown --quantization {q!r}; known: {', '.join(ENGINE_QUANTIZATIONS)}")
    if not names:
        raise ValueError(f"--quantization needs at least one of {', '.join(ENGINE_QUANTIZATIONS)}, got {text!r}")
    return list(dict.fromkeys(names))


def _batches(args: argparse.Namespace) -> list[int] | None:
    return None if args.batch is None else [args.batch] if isinstance(args.batch, int) else list(args.batch)


def _model_config(spec: str) -> Any:
    """The engine's ModelConfig behind ``spec`` (None for the fixtures), for the MoE section."""
    from roofline.config import MODEL_PRESETS, ModelConfig, model_preset

    if spec in MODEL_PRESETS:
        return model_preset(spec)
    path = Path(spec)
    path = path / "config.json" if path.is_dir() else path
    return ModelConfig.from_hf_config(json.loads(path.read_text())) if path.is_file() else None


def _moe_section(spec: str, hw: Any, fmt: str, batches: list[int], context: int, kv_dtype: str,
                 shape: cm.ModelShape, ep: int | None = None, link: Any = None) -> tuple[dict[str, Any], str] | None:
    """Expected touched experts and the MoE floor per batch (``roofline.costmodel.moe``); None for dense models."""
    from roofline.costmodel.moe import MoEShape, format_moe_table, moe_decode_floor

    mc = _model_config(spec) if spec not in cm.FIXTURE_SHAPES else None
    if mc is None or not mc.is_moe:
        return None
    moe = MoEShape.from_model_config(mc)
    kv = shape.kv_bytes_per_sequence(context, kv_dtype)
    rows = [moe_decode_floor(moe, b, kv, hw.memory_bandwidth, hw.peak("bf16"), fmt) for b in batches]
    data = dict(num_experts=moe.num_experts, top_k=moe.top_k, num_moe_layers=moe.num_moe_layers,
                expert_params=moe.expert_params, dense_params=moe.dense_params, active_params=moe.active_params,
                format=fmt, context=context, rows=rows)
    text = format_moe_table(moe, rows, fmt, hw.name if hasattr(hw, "name") else str(hw))
    if ep is not None and ep > 1:  # a projection for expert parallelism on ``ep`` GPUs
        from roofline.costmodel.moe import moe_ep_projection

        proj = [moe_ep_projection(moe, ep, b, kv, hw.memory_bandwidth, hw.peak("bf16"), mc.num_hidden_layers,
                                  mc.hidden_size, link.bandwidth, link.latency_s, fmt) for b in batches]
        data["expert_parallel_projection"] = dict(ep=ep, link=link.name, rows=proj)
        text += (f"\nPROJECTION, expert parallel on {ep} GPUs (--tp {ep} --enable-expert-parallel; E/{ep} experts and "
                 f"1/{ep} of attention per GPU, 2 all-reduces per layer over {link.name}; not measured):\n"
                 f"  {'batch':>6} {'touched/GPU':>12} {'GB/GPU':>8} {'comm ms':>8} {'floor ms':>9} {'floor tok/s':>12}")
        for r in proj:
            text += (f"\n  {r['batch']:>6} {r['touched_per_gpu']:>12.2f} {r['weight_bytes_per_gpu'] / 1e9:>8.3f} "
                     f"{r['comm_s'] * 1e3:>8.3f} {r['floor_s'] * 1e3:>9.3f} {r['floor_tok_per_s']:>12.1f}")
    return data, text


def _validate(args: argparse.Namespace) -> None:
    batches = _batches(args)
    if batches is not None and min(batches) < 1:
        raise ValueError(f"--batch must be an integer >= 1, got {min(batches)}")
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
        quants = _quantizations(args.quantization)
        formats = args.format or [("bf16" if q == "none" else q) for q in quants] or list(cm.DEFAULT_FORMATS)
        for f in formats:
            cm.parse_weight_format(f)
        batches = _batches(args) or [defaults.get("batch", DEFAULTS["batch"])]
        batch = batches[0]
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
        if quants:
            if shape.intermediate_size <= 0:
                raise ValueError(f"--quantization needs a dense model with an intermediate_size; {args.model!r} "
                                 "has none (the fixture, or a MoE model)")
            report["quantization"] = build_quantization(shape, hw, quants, batches, context, kv_dtype)
        moe = _moe_section(args.model, hw, formats[0], batches, context, kv_dtype, shape, args.tp,
                           load_interconnect(args.interconnect, args.link_bandwidth, args.link_latency_us))
        if moe is not None:
            report["moe"] = moe[0]
    except ValueError as e:
        return _error("cost", str(e))
    if args.plot:
        try:
            write_plot(args.plot, shape, hw, formats, kv_dtype, context, batch, args.gamma, args.draft_cost)
        except OSError as e:
            return _error("cost", f"cannot write plot {args.plot!r}: {e}")
        report["plot"] = str(args.plot)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    if moe is not None and not args.json:
        print("\nThe table above counts every expert's weights (all touched: a large batch). By batch:")
        print(moe[1])
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
        print(f"  gemm {dtype:<5}" + (f"{rate / 1e12:10.3f} {cm.rate_unit(dtype)} (n={d['gemm_n']})" if rate
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
    p.add_argument("--quantization", default=None, metavar="METHOD[,METHOD]",
                   help="vLLM's load-time methods (none, int4, int8, fp8, smoothquant; a comma list): per method and "
                        "--batch, the bound from the engine's bytes (codes + scales + zeros) and, where the "
                        "--hardware has a measured kernel table (h200), the step predicted from measured kernels; "
                        "also sets the formats of the tables above unless --format is given")
    p.add_argument("--kv-dtype", default=None,
                   help=f"KV cache dtype ({', '.join(cm.KV_DTYPE_BYTES)}); default bf16. int8 also counts its "
                        "float32 scale per token and KV head, as the engine's pool does")
    p.add_argument("--batch", type=_batch_list, default=None,
                   help="sequences per step (default 32); a list (1,8,64) adds rows to the --quantization and MoE "
                        "sections, and the tables above use the first")
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

