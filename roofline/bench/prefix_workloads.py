"""The engine side of ``roofline bench prefix`` (:mod:`roofline.bench.prefix`): latency statistics, the engine
with or without prefix caching, a step meter, and the three workloads (multi-turn replay, few-shot,
self-consistency), each driven as the offline API drives it.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from roofline.bench.prefix_inputs import model_tokenizer

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


def on_off_ratio(on: float | None, off: float | None) -> float | None:
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


def warmup_engine(engine: Any, seed: int) -> None:
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
