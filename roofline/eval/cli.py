"""``roofline eval``: the quality gate. Prints one row per configuration (baseline first) and writes JSON.

Examples:
    roofline eval --kv-cache-dtype float16            # float16 KV against the same args with kv auto
    roofline eval --candidates kv_cache_dtype=int8 kv_cache_dtype=fp8_e4m3
    roofline eval --num-eval-tokens 2048 --passkey-lengths 1024 --output-json eval.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from roofline.args import EngineArgs
from roofline.eval import runner


def _depths(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"depths must be comma-separated fractions in [0, 1], got {text!r}") from e


def _lengths(text: str) -> list[int]:
    from roofline.bench.common import parse_sizes

    try:
        return parse_sizes(text) if text.strip().lower() not in ("", "none", "0") else []
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="quality gate: perplexity, KL and top-1 agreement vs the unquantized baseline, and passkey",
        description="Compare candidate configurations (the baseline's engine args plus overrides) with the "
                    "baseline (the same args, KV-cache and weight formats at their defaults) on a held-out "
                    "ShareGPT slice and a passkey retrieval check.")
    EngineArgs.add_cli_args(p)
    g = p.add_argument_group("eval")
    g.add_argument("--candidates", nargs="+", default=None, metavar="FIELD=VALUE[,FIELD=VALUE]",
                   help="one candidate per argument, each the baseline's EngineArgs with these overrides "
                        "(e.g. kv_cache_dtype=int8 kv_cache_dtype=fp8_e4m3). A quality flag given directly "
                        "(--kv-cache-dtype X) adds a candidate too. Default, when neither is given: "
                        "kv_cache_dtype=int8 and kv_cache_dtype=fp8_e4m3")
    g.add_argument("--num-eval-tokens", type=int, default=runner.DEFAULT_NUM_EVAL_TOKENS,
                   help="tokens of held-out ShareGPT text (default 51200: 50 windows of 1024, 51,150 scored)")
    g.add_argument("--window", type=int, default=runner.DEFAULT_WINDOW, help="tokens per scored window")
    g.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: window)")
    g.add_argument("--passkey-lengths", type=_lengths,
                   default=list(runner.DEFAULT_PASSKEY_LENGTHS),
                   help="passkey prompt lengths in tokens, comma-separated, k = x1024 (default 6144; 0: skip)")
    g.add_argument("--passkey-depths", type=_depths, default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="key depths as fractions of the filler (default 0,0.25,0.5,0.75,1)")
    g.add_argument("--passkey-prompt", choices=["chat", "plain"], default="chat",
                   help="the passkey question in the model's chat template (default) or as a plain completion")
    g.add_argument("--kv-budget", default=runner.DEFAULT_KV_BUDGET,
                   help="KV memory at which the table's pool token counts are given (default 1GiB)")
    g.add_argument("--greedy-prompts", type=int, default=64,
                   help="held-out chat prompts every configuration answers greedily; a prompt agrees when all its "
                        "tokens equal the baseline's (default 64; 0: skip)")
    g.add_argument("--greedy-tokens", type=int, default=64, help="tokens generated per greedy prompt (default 64)")
    g.add_argument("--output-json", default=None, help="write the full results here")
    p.set_defaults(func=run_eval_command)


def run_eval_command(args: argparse.Namespace) -> int:
    from roofline.args import parse_kv_cache_memory, resolve_device

    base = EngineArgs.from_cli_args(args)
    budget, _ = parse_kv_cache_memory(args.kv_budget, "--kv-budget")
    if budget is None:
        raise ValueError(f"--kv-budget must be a byte size (e.g. 1GiB), got {args.kv_budget!r}")
    cfg = runner.EvalConfig(
        num_eval_tokens=args.num_eval_tokens, window=args.window, stride=args.stride,
        passkey_lengths=tuple(args.passkey_lengths), passkey_depths=tuple(args.passkey_depths),
        passkey_form=args.passkey_prompt, kv_budget_bytes=budget, greedy_prompts=args.greedy_prompts,
        greedy_tokens=args.greedy_tokens)
    candidates = runner.candidates_from_args(base, args.candidates)
    if not candidates:
        baseline = runner.baseline_args(base)
        on_cuda = resolve_device(baseline.device).startswith("cuda")
        dtype = baseline.dtype if baseline.dtype != "auto" else ("bfloat16" if on_cuda else "float32")
        candidates = runner.default_candidates(dtype)
    result = runner.run_eval(base, candidates, cfg)
    print(runner.format_table(result))
    d = result["dataset"]
    print(f"{d['num_scored_tokens']:,} tokens scored in {d['num_windows']} windows of {d['window']} "
          f"(stride {d['stride']}); {d['slice']}")
    print(f"wall time {result['wall_time_s']:.1f} s (scoring {result['score_time_s']:.1f} s, passkey "
          f"{result['passkey_time_s']:.1f} s, the rest loading)")
    if args.output_json:
        from roofline.bench.common import environment

        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"benchmark": "eval", **environment(), **result}, indent=1, default=str))
        print(f"wrote {path}")
    return 0
