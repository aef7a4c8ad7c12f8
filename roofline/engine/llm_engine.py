"""LLMEngine: validates and queues requests, runs schedule -> execute -> update, detokenizes, stops.

One engine step:
    SchedulerOutput = scheduler.schedule()            pure Python
    StepInput       = self._step_input(output)        ids and counts: what the worker does not know yet
    StepOutput      = executor.execute_model_async(input).result()   tensors live only in the worker
    scheduler.update(output, sampled)                 append tokens
    stop checks + detokenizer                         finish sequences, free their blocks at once

Prefix caching (``CacheConfig.enable_prefix_caching``, on by default): a ``RadixCache`` over the
``BlockPool``, driven by the Scheduler (match at admission, insert as steps complete, evict before
preempting). ``add_request`` links the samples of an ``n > 1`` request so that they share sample 0's cached
prompt blocks; a request asking for prompt logprobs computes its whole prompt (no match) but is cached.

This module imports no torch: the executor (``roofline.worker``) is imported where the engine is built.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from roofline.config import EngineConfig, ModelConfig
from roofline.engine.block_pool import BlockPool
from roofline.engine.detokenizer import Detokenizer, emittable_text, find_stop_string
from roofline.engine.radix_cache import RadixCache
from roofline.engine.scheduler import Scheduler, SchedulerOutput
from roofline.engine.sequence import Logprob, Sequence, SequenceStatus
from roofline.engine.step import CachedRequest, NewRequest, StepInput
from roofline.outputs import CompletionOutput, RequestMetrics, RequestOutput
from roofline.sampling_params import SamplingParams
from roofline.spec_decode.ngram import ngram_propose
from roofline.spec_decode.policy import SpecPolicy
from roofline.spec_decode.stats import SpecDecodeStats

if TYPE_CHECKING:
    from roofline.models import loader

logger = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """Timing of one engine step, kept for run statistics and the floor comparison."""

    duration_s: float
    num_seqs: int
    num_tokens: int
    is_decode_only: bool
    context_tokens: int  # sum over sequences of keys read by attention


@dataclass
class EngineStats:
    """Cumulative step counters (callers diff two snapshots for one run) and a bounded window of records."""

    num_steps: int = 0
    num_decode_steps: int = 0
    decode_time_s: float = 0.0
    decode_seqs: int = 0  # summed over decode-only steps
    decode_kv_tokens: int = 0  # keys read, summed over decode-only steps and their sequences
    num_preemptions: int = 0
    # Prefix cache: prompt tokens looked up at first admission, those found cached, blocks evicted.
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    num_prefix_cache_evictions: int = 0
    recent: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=4096))

    def record(self, rec: StepRecord) -> None:
        self.num_steps += 1
        self.recent.append(rec)
        if rec.is_decode_only:
            self.num_decode_steps += 1
            self.decode_time_s += rec.duration_s
            self.decode_seqs += rec.num_seqs
            self.decode_kv_tokens += rec.context_tokens

    def steps_since(self, step_index: int) -> list[StepRecord]:
        """Records of steps ``step_index`` (a past ``num_steps``) onwards.

        Raises:
            ValueError: those steps have left the bounded window.
        """
        n = self.num_steps - step_index
        if n > len(self.recent):
            raise ValueError(f"step {step_index} is older than the last {len(self.recent)} kept records")
        return list(self.recent)[len(self.recent) - n:] if n > 0 else []

    def snapshot(self) -> tuple[int, float, int, int, int, int, int]:
        return (self.num_decode_steps, self.decode_time_s, self.decode_seqs, self.decode_kv_tokens,
                self.num_preemptions, self.num_prefix_cache_queries, self.num_prefix_cache_hits)


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    arrival_time: float
    stream: bool = True  # report every step (servers); False: only the final output (offline batches)
    # SamplingParams.prompt_logprobs: entry i scores prompt token i (entry 0 stays None); filled as chunks run.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # set when the worker failed one of its sequences (StepOutput.errors)


class LLMEngine:
    def __init__(self, config: EngineConfig, source: loader.ModelSource, model_config: ModelConfig,
                 tokenizer: Any = None):
        from roofline.worker.executor import UniProcExecutor

        self.model_config = model_config
        self.tokenizer = tokenizer
        if config.parallel_config.distributed_executor_backend == "external_launcher":
            from roofline.worker.external_launcher import ExternalLauncherExecutor

            self.executor: Any = ExternalLauncherExecutor(config, source, model_config)
        elif config.parallel_config.uses_worker_processes:
            from roofline.worker.multiproc_executor import MultiprocExecutor

            self.executor = MultiprocExecutor(config, source, model_config)
        else:
            self.executor = UniProcExecutor(config, source, model_config)
        sc = config.scheduler_config
        if sc.budget_from_profile:
            budget = self.executor.profile_budget()
            sc = dataclasses.replace(sc, max_num_batched_tokens=budget, budget_from_profile=False)
            config = dataclasses.replace(config, scheduler_config=sc)
        self.config = config
        cc = config.cache_config
        num_blocks = self.executor.num_kv_blocks
        capacity = num_blocks * cc.block_size
        if capacity < sc.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {cc.block_size}), "
                f"less than max_model_len ({sc.max_model_len}); raise the KV-cache memory or lower "
                f"--max-model-len"
            )
        per_token = self.worker.kv_bytes_per_token
        self.kv_cache_summary = (
            f"KV cache: {capacity} tokens ({num_blocks} blocks of {cc.block_size}, {cc.kv_cache_dtype}, "
            f"{per_token} bytes/token, {capacity * per_token / 2**30:.2f} GiB); per-step token budget "
            f"{sc.max_num_batched_tokens}")
        logger.info("%s", self.kv_cache_summary)
        self.block_pool = BlockPool(num_blocks, cc.block_size)
        self.prefix_cache = RadixCache(self.block_pool) if cc.enable_prefix_caching else None
        self.scheduler = Scheduler(sc, self.block_pool, self.prefix_cache)
        self.detokenizer = Detokenizer(tokenizer)
        self.requests: dict[str, _Request] = {}
        self.stats = EngineStats()
        self.eos_token_ids = set(model_config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))
        self._ids = itertools.count()
        # What the worker knows: blocks sent per live sequence, every sequence it holds state for, and the
        # sequences to tell it to forget at the next step.
        self._worker_blocks: dict[int, int] = {}
        self._worker_seqs: set[int] = set()
        self._finished_seq_ids: list[int] = []
        self._inflight: tuple[SchedulerOutput, Any] | None = None  # the launched step not yet processed
        self._refill: tuple[int, int] | None = None  # (batch, gamma) of a drafting step the next async step follows
        self.spec_config = config.speculative_config
        self.spec_stats = SpecDecodeStats()
        self.spec_policy: SpecPolicy | None = None
        if self.spec_config is not None:
            self.spec_policy = self._make_spec_policy()

    def _make_spec_policy(self) -> SpecPolicy:
        """The gamma policy, with the bound model's verify ratio at this model's bytes and FLOPs and this
        device's read bandwidth and GEMM rate, measured once here."""
        from roofline import costmodel
        from roofline import hardware as hw

        spec = self.spec_config
        assert spec is not None
        worker = self.worker
        dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[str(worker.dtype).removeprefix("torch.")]
        bandwidth = hw.measure_read_bandwidth(str(worker.device))
        peak = hw.measure_gemm_flops(str(worker.device), dtype)
        num_params = self.model_config.num_params
        weight_bytes = worker.weight_bytes_per_step
        kv_per_token = worker.kv_bytes_per_token
        self._spec_context = 512  # keys per sequence assumed by the verify ratio; updated from the batch

        def verify_ratio(batch: int, gamma: int) -> float:
            return costmodel.verify_cost_ratio(num_params, weight_bytes, self._spec_context * kv_per_token, batch,
                                               bandwidth, peak, gamma)

        # The starting estimate of c (a draft step over a target step), until the engine has timed both.
        draft_cost = 0.0
        if spec.method == "draft_model" and spec.num_layers is not None:
            draft_cost = spec.num_layers / self.model_config.num_hidden_layers
        elif spec.method == "draft_model":  # a separate draft: its weight bytes over the target's (decode reads)
            draft = getattr(worker, "draft", None)
            draft_cost = draft.weight_bytes / weight_bytes if draft is not None else 0.5
        logger.info("speculative decoding: %s, gamma_max %d, %s; verify ratio from %.1f GB/s and %.2f TFLOP/s "
                    "(%s, measured)", spec.method, spec.num_speculative_tokens,
                    "adaptive gamma" if spec.adaptive else "fixed gamma", bandwidth / 1e9, peak / 1e12, dtype)
        return SpecPolicy(spec.num_speculative_tokens, spec.adaptive, verify_ratio, draft_cost)

    @staticmethod
    def _may_speculate(seq: Sequence) -> bool:
        """Requests with penalties (which depend on every earlier token) or still below min_tokens (whose
        stop-token ban lifts mid-run) decode without drafts."""
        p = seq.sampling_params
        return (p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
                and seq.num_output_tokens >= p.min_tokens)

    def _propose(self) -> None:
        """Before scheduling: choose gamma for the decoding requests (the policy) and fill their drafts. Every
        decoding request counts in the policy's batch: one that may not speculate (penalties, below min_tokens,
        no room left) with a cap of 0, since it waits for the longer verify step too."""
        spec, policy = self.spec_config, self.spec_policy
        assert spec is not None and policy is not None
        sc = self.config.scheduler_config
        for seq in self.scheduler.running:
            seq.spec_token_ids = []
        if policy.adaptive and self._prefill_pending():
            return  # see SpecPolicy.drafting_due: a step that carries prefill work does not draft
        cands, caps, drafts = [], [], []
        for seq in self.scheduler.running:
            if seq.num_uncomputed_tokens != 1:
                continue
            p = seq.sampling_params
            room = sc.max_model_len - seq.num_tokens - 1
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - seq.num_output_tokens - 1)
            k = min(spec.num_speculative_tokens, room) if self._may_speculate(seq) else 0
            if k <= 0:
                d = []
            elif spec.method == "ngram":
                d = ngram_propose(seq.token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max)
            else:
                d = [-1] * k
            cands.append(seq)
            caps.append(len(d))
            drafts.append(d)
        if not cands or max(caps) == 0:
            if cands:  # nothing to draft (no n-gram match): not a policy decision, not counted as off
                policy.no_drafts([s.seq_id for s in cands])
            return
        self._spec_context = max(1, sum(s.num_tokens for s in cands) // len(cands))
        gamma = policy.choose([s.seq_id for s in cands], caps)
        self.spec_stats.gamma = gamma
        if gamma == 0:
            self.spec_stats.num_steps_off += 1
        for seq, d in zip(cands, drafts, strict=True):
            p = seq.sampling_params
            # A seeded random request drafts gamma_max (what it can): its draws then depend on its own tokens
            # and seed only, not on the batch or on timings.
            pinned = p.seed is not None and not p.is_greedy
            seq.spec_token_ids = d if pinned else d[:gamma]

    @property
    def block_manager(self) -> BlockPool:
        """The block pool under its older name (benchmarks and tests read its counts through it)."""
        return self.block_pool

    @property
    def worker(self) -> Any:
        """The in-process worker (model, KV pool, device): for reports and benchmarks."""
        return self.executor.worker

    @classmethod
    def from_config(cls, model: str | None, config_factory: Any = None, load_format: str = "auto",
                    **overrides: Any) -> LLMEngine:
        """Resolve ``model``, read its config and tokenizer, and build the engine.

        ``config_factory(model_config) -> EngineConfig`` lets callers (the CLI, ``LLM``) fill the rest.
        """
        from roofline.models import loader

        source = loader.resolve_model(model, load_format)
        model_config = loader.load_config(source)
        config = config_factory(model_config) if config_factory else EngineConfig(model_config=model_config)
        tokenizer = loader.load_tokenizer(source)
        return cls(config, source, model_config, tokenizer)

    # ------------------------------------------------------------------------------ requests

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights); pass prompt token ids")
        return list(self.tokenizer(prompt, add_special_tokens=True).input_ids)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError, naming the value and allowed range, before anything is scheduled."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty; it must contain at least 1 token")
        max_len = self.config.scheduler_config.max_model_len
        if n >= max_len:
            raise ValueError(
                f"prompt has {n} tokens, but max_model_len is {max_len}; the prompt must be at most "
                f"{max_len - 1} tokens to leave room for one generated token"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is out of range [0, {vocab})")
        params.verify_for_model(vocab)
        if params.n > self.config.scheduler_config.max_num_seqs:
            raise ValueError(f"n must be <= max_num_seqs ({self.config.scheduler_config.max_num_seqs}), "
                             f"got {params.n}")

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, stream: bool = True) -> str:
        """Validate and queue a request (``params.n`` sample streams). Returns the request id.

        With ``stream=False`` the request appears in ``step()``'s outputs only when it finishes (saves
        building an output per token for offline batches).

        Raises:
            ValueError: empty or too-long prompt, token ids out of range, duplicate request id, or an
                invalid SamplingParams (raised at construction). Nothing is queued then.
        """
        params = params.clone() if params is not None else SamplingParams()
        request_id = request_id if request_id is not None else self.next_request_id()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text: str | None = prompt
            if prompt == "":
                raise ValueError("prompt is empty; it must contain at least 1 token")
            token_ids = self.tokenize(prompt)
        else:
            text, token_ids = None, list(prompt)
        self.validate(token_ids, params)
        params._all_stop_token_ids = set(self.eos_token_ids)
        now = arrival_time if arrival_time is not None else time.monotonic()
        seqs = [Sequence(request_id, token_ids, params, index=i, prompt=text, arrival_time=now)
                for i in range(params.n)]
        bs = self.config.cache_config.block_size
        if self.prefix_cache is not None and len(seqs) > 1 and (len(token_ids) - 1) // bs >= 1 \
                and getattr(params, "prompt_logprobs", None) is None:
            # n > 1: samples 1.. share the prompt's full blocks once sample 0 has cached them (Scheduler).
            for seq in seqs[1:]:
                seq.fork_of = seqs[0]
        for seq in seqs:
            self.detokenizer.start(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = _Request(request_id, text, token_ids, seqs, now, stream,
                                             [None] if params.prompt_logprobs is not None else None)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Finish a request's sequences as aborted and free their blocks now. False if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                self._release(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------------------ the step

    def _check_stop_token(self, seq: Sequence, token: int) -> SequenceStatus | None:
        """EOS (any of the model's ids, unless ignore_eos) or a stop token id, once past min_tokens."""
        p = seq.sampling_params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in p._all_stop_token_ids:
                return SequenceStatus.FINISHED_STOPPED
            if token in (p.stop_token_ids or []):
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
        return None

    def _check_length(self, seq: Sequence) -> SequenceStatus | None:
        p = seq.sampling_params
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.config.scheduler_config.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; returns an output for every request that changed.

        With async scheduling (``EngineConfig.async_scheduling``, the default on GPUs) the step launched here
        is processed by the next call: this call schedules and launches step N+1, then waits for step N's
        sampled ids and processes them, so the host's scheduling and input preparation hide behind the GPU's
        work. If a step fails, its error propagates and the caller aborts the affected requests (``LLM``
        does); a step still in flight is processed, its finished sequences dropping their tokens.

        Speculative decoding: a step that drafts needs its requests' newest tokens, and its accepted tokens
        decide the next step's inputs, so it runs synchronously (the step in flight is processed first); if
        the policy then drafts nothing (gamma 0, or no n-gram match), the step is left in flight like an async
        one. While the policy has speculation off, or for a few steps after one that found no draft, steps stay
        asynchronous and propose nothing, until a probe is due or a new request joins a small batch; with the
        adaptive policy a step that will carry prefill work does not draft either (``_drafting_due``;
        ``SpecPolicy.drafting_due``). The first async step after a drafting step launches with none in flight:
        its host time is charged to the drafting step (``SpecPolicy.record_refill``).
        """
        if self.spec_policy is not None and (not self.config.async_scheduling or self._drafting_due()):
            self._refill = None
            done = self._drain()
            t0 = time.perf_counter()
            self._propose()
            out = self.scheduler.schedule()
            if out.is_empty:
                return done
            pending = self._launch(out)
            if self.config.async_scheduling and not any(s.spec_token_ids for s in out.scheduled):
                # Nothing drafted after all (gamma 0, no n-gram match): the step stays in flight, as an async
                # one, and the next call processes it while its successor runs.
                self._inflight = (out, pending)
                return done
            return done + self._process(out, pending, wall_t0=t0, mode="draft")
        if self.spec_policy is not None:
            self._skip_drafting()
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        pending = self._launch(out) if not out.is_empty else None
        if not self.config.async_scheduling and pending is not None:
            return self._process(out, pending, mode="sync")
        prev, self._inflight = self._inflight, ((out, pending) if pending is not None else None)
        refill, self._refill = self._refill, None
        if prev is None and refill is not None and pending is not None:
            # The first async step after a drafting step: its host work (scheduling, inputs, launch) hides behind
            # no step in flight. A cost of the drafting step, charged to its verify timing.
            assert self.spec_policy is not None
            self.spec_policy.record_refill(*refill, time.perf_counter() - t0)
        # In the steady state one call launches one step and processes one: its wall time is a plain decode
        # step's period when both are decode-only. A step launched with a prefill chunk runs eager, and its
        # launch (tens of ms of host time on a small model) would be charged to the step processed here.
        steady = pending is not None and out.is_decode_only
        return self._process(*prev, wall_t0=t0 if steady else None, mode="async") if prev is not None else []

    def _drain(self) -> list[RequestOutput]:
        """Process the step in flight, if any."""
        prev, self._inflight = self._inflight, None
        return self._process(*prev, mode="drain") if prev is not None else []

    def _drafting_due(self) -> bool:
        """Whether this step proposes drafts, and so runs synchronously (``SpecPolicy.drafting_due``)."""
        assert self.spec_policy is not None
        decoding, prefill = [], self.scheduler.num_waiting > 0  # one pass over the batch (every step)
        for s in self.scheduler.running:
            if s.is_prefill:
                prefill = True
            else:
                decoding.append(s.seq_id)
        return self.spec_policy.drafting_due(decoding, prefill)

    def _prefill_pending(self) -> bool:
        """Whether the next step will likely carry prefill work: a waiting request, or a running sequence with
        more than one token to compute (a chunked prompt, a recompute after preemption)."""
        return self.scheduler.num_waiting > 0 or any(s.is_prefill for s in self.scheduler.running)

    def _skip_drafting(self) -> None:
        """A step run without drafts (async): clear any drafts a sequence kept from a drafting step that did
        not schedule it, since an async step must carry none; counts toward a probe while the policy is off."""
        assert self.spec_policy is not None
        decoding = False
        for seq in self.scheduler.running:
            seq.spec_token_ids = []
            decoding = decoding or not seq.is_prefill
        if decoding and self.spec_policy.skip():
            self.spec_stats.num_steps_off += 1

    def _launch(self, out: SchedulerOutput) -> Any:
        step_input = self._step_input(out)
        try:
            return self.executor.execute_model_async(step_input)
        except BaseException:
            self._rollback(out, step_input)
            raise

    def _rollback(self, out: SchedulerOutput, step_input: StepInput) -> None:
        """A step that failed: undo its progress, and resend its sequences whole to the worker."""
        for s in out.scheduled:
            s.seq.num_computed_tokens = s.start_position
            if s.samples:
                s.seq.num_placeholders -= 1
        for sid, _ in step_input.scheduled:
            self._worker_blocks.pop(sid, None)
        self._finished_seq_ids.extend(step_input.finished_seq_ids)

    def _process(self, out: SchedulerOutput, pending: Any, wall_t0: float | None = None,
                 mode: str = "sync") -> list[RequestOutput]:
        """Wait for a launched step's sampled ids, append them, check stops, build outputs.

        ``wall_t0``: when this step's wall time began (its proposal, or the call that launched the next
        step while this one ran), for the speculative policy's step timings; None: not a steady-state step.
        ``mode``, for the debug-level step trace: "async" (processed while the next step runs), "drain" (the
        step in flight processed before a drafting step), "draft" (a drafting step, run synchronously) or
        "sync" (async scheduling off)."""
        try:
            result = pending.result()
        except BaseException:
            self._rollback(out, pending.step_input)
            raise
        self.stats.record(StepRecord(
            duration_s=result.duration_s,
            num_seqs=len(out.scheduled),
            num_tokens=out.num_batched_tokens,
            is_decode_only=out.is_decode_only,
            context_tokens=sum(s.start_position + s.num_scheduled_tokens for s in out.scheduled),
        ))
        self.stats.num_preemptions = self.scheduler.num_preemptions
        if self.prefix_cache is not None:
            self.stats.num_prefix_cache_queries = self.prefix_cache.num_query_tokens
            self.stats.num_prefix_cache_hits = self.prefix_cache.num_hit_tokens
            self.stats.num_prefix_cache_evictions = self.prefix_cache.num_evicted_blocks
        sampled = dict(zip(result.seq_ids, result.sampled_token_ids, strict=True))
        logprobs = {sid: lps for sid, lps in zip(result.seq_ids, result.logprobs, strict=True) if lps}
        if result.prompt_logprobs:
            self._add_prompt_logprobs(out, result.prompt_logprobs)
        spec_seqs = {s.seq.seq_id: len(s.spec_token_ids) for s in out.scheduled if s.spec_token_ids}
        if spec_seqs:
            self._record_spec(spec_seqs, result)
        # A steady-state step of decodes only (no prefill chunk; not one drained before a drafting step, whose
        # launch-to-result time is not a step period) teaches the policy the measured verify ratio, timed below.
        timed = self.spec_policy is not None and wall_t0 is not None and all(
            s.num_scheduled_tokens == 1 + len(s.spec_token_ids) for s in out.scheduled)
        changed = self.scheduler.update(out, sampled)
        touched: dict[str, _Request] = {}
        now = time.monotonic()
        errors = getattr(result, "errors", None) or {}
        for seq in changed:
            if str(seq.seq_id) in errors:  # fail only this request: its token this step is meaningless
                if seq.seq_id not in spec_seqs and seq.output_token_ids:
                    seq.output_token_ids.pop()
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
                self._release(seq)
                req = self.requests.get(seq.request_id)
                if req is not None:
                    req.error = errors[str(seq.seq_id)]
                    touched[req.request_id] = req
                logger.warning("request %s failed: %s", seq.request_id, errors[str(seq.seq_id)])
                continue
            # A verify step's tokens are appended here one at a time, each checked as a step's single token is.
            new = sampled[seq.seq_id] if seq.seq_id in spec_seqs else [seq.output_token_ids[-1]]
            for i, token in enumerate(new):
                if seq.seq_id in spec_seqs:
                    seq.append_token(token, now)
                lps = logprobs.get(seq.seq_id)
                if lps is not None:
                    self._add_logprob(seq, token, lps[i] if seq.seq_id in spec_seqs else lps[-1])
                status = self._check_stops(seq, token)
                if status is not None:
                    self.scheduler.finish(seq, status)
                    self._release(seq)
                    break
            req = self.requests.get(seq.request_id)
            if req is not None:
                touched[req.request_id] = req
        outputs = []
        for req in touched.values():
            if not req.stream and not all(s.is_finished for s in req.seqs):
                continue
            ro = self._make_output(req)
            outputs.append(ro)
            if ro.finished:
                del self.requests[req.request_id]
        if timed:
            # Its whole wall time: the proposer's and the host's work, and the processing of its tokens (a
            # verify pass emits several per request, each detokenized and checked for stops: on a host-bound
            # model that is a large part of a step), the draft model's time excluded (it is c).
            assert self.spec_policy is not None and wall_t0 is not None
            gamma = max(spec_seqs.values(), default=0)
            self.spec_policy.record_step(len(out.scheduled), gamma,
                                         time.perf_counter() - wall_t0 - result.draft_duration_s)
            if gamma > 0 and mode == "draft":
                self._refill = (len(out.scheduled), gamma)
        if logger.isEnabledFor(logging.DEBUG):
            self._trace(out, result, mode, spec_seqs)
        return outputs

    def _trace(self, out: SchedulerOutput, result: Any, mode: str, spec_seqs: dict[int, int]) -> None:
        """One debug line per processed step, for finding where a run's time goes (``bench/step_trace.py``
        summarizes a log of them): when it ended (``time.perf_counter``, s), how it ran (``mode``), its decode
        and prefill work, and its speculative tokens."""
        decode = sum(1 for s in out.scheduled if s.num_scheduled_tokens == 1 + len(s.spec_token_ids))
        prefill = sum(s.num_scheduled_tokens for s in out.scheduled
                      if s.num_scheduled_tokens != 1 + len(s.spec_token_ids))
        accepted = sum(result.num_accepted.get(sid, 0) for sid in spec_seqs)
        logger.debug("step trace: end=%.6f mode=%s decode=%d prefill_tokens=%d spec_seqs=%d drafted=%d "
                     "accepted=%d device_ms=%.3f waiting=%d gamma=%d", time.perf_counter(), mode, decode, prefill,
                     len(spec_seqs), sum(spec_seqs.values()), accepted, result.duration_s * 1e3,
                     self.scheduler.num_waiting, self.spec_stats.gamma)

    def _add_logprob(self, seq: Sequence, token: int, lp: dict[int, Logprob]) -> None:
        if self.tokenizer is not None:
            for tid, entry in lp.items():
                entry.decoded_token = self.tokenizer.decode([tid])
        seq.output_logprobs.append(lp)
        seq.cumulative_logprob += lp[token].logprob

    def _check_stops(self, seq: Sequence, token: int) -> SequenceStatus | None:
        """After ``token`` was appended: in vLLM's order, stop token, stop string, then the length limits."""
        status = self._check_stop_token(seq, token)
        before = len(seq.output_text)
        self.detokenizer.decode_new(seq)
        if status is None and seq.num_output_tokens >= seq.sampling_params.min_tokens:
            stop = find_stop_string(seq, len(seq.output_text) - before)
            if stop is not None:
                seq.stop_reason = stop
                status = SequenceStatus.FINISHED_STOPPED
        if status is None:
            status = self._check_length(seq)
        return status

    def _record_spec(self, spec_seqs: dict[int, int], result: Any) -> None:
        """Acceptance counters and the policy's estimates (alpha per request, the draft cost c)."""
        policy = self.spec_policy
        assert policy is not None
        self.spec_stats.num_steps_on += 1
        for sid, k in spec_seqs.items():
            a = result.num_accepted.get(sid, 0)
            self.spec_stats.record(k, a)
            policy.record(sid, k, a)
        gamma = max(spec_seqs.values())
        verify_s = max(result.duration_s - result.draft_duration_s, 1e-9)
        if result.draft_duration_s > 0:  # the n-gram proposer's host time is inside the step's wall time
            policy.record_cost(result.draft_duration_s / gamma, verify_s)

    def _add_prompt_logprobs(self, out: SchedulerOutput,
                             scored: dict[int, tuple[int, list[dict[int, Logprob]]]]) -> None:
        """Place a step's prompt-logprob entries at their token indices in their request's list.

        Every sample of a request scores the prompt it computes, and a resumed sequence scores it again: an
        index already filled keeps its first entry, so the list is complete once any sample has a token.
        """
        seqs = {s.seq.seq_id: s.seq for s in out.scheduled}
        decoded: dict[int, str] = {}
        for sid, (first, entries) in scored.items():
            req = self.requests.get(seqs[sid].request_id)
            if req is None or req.prompt_logprobs is None:
                continue  # aborted meanwhile
            lps = req.prompt_logprobs
            if len(lps) < first:
                lps.extend([None] * (first - len(lps)))  # tokens this request's sequences did not compute
            for i, entry in enumerate(entries, start=first):
                if i < len(lps) and lps[i] is not None:
                    continue  # a repeat (another sample, or a resumed sequence)
                if self.tokenizer is not None:
                    for tid, lp in entry.items():
                        if tid not in decoded:
                            decoded[tid] = self.tokenizer.decode([tid])
                        lp.decoded_token = decoded[tid]
                if i < len(lps):
                    lps[i] = entry
                else:
                    lps.append(entry)

    def _step_input(self, out: SchedulerOutput) -> StepInput:
        """Tell the worker only what it does not know: new (or resumed) sequences whole, running ones'
        new blocks and progress, and the sequences to forget."""
        step = StepInput(finished_seq_ids=self._finished_seq_ids,
                         preempted_seq_ids=[s.seq_id for s in out.preempted])
        self._finished_seq_ids = []
        for seq in out.preempted:
            self._worker_blocks.pop(seq.seq_id, None)
        for s in out.scheduled:
            seq = s.seq
            known = self._worker_blocks.get(seq.seq_id)
            if known is None:
                step.new_requests.append(NewRequest(
                    seq.seq_id, seq.token_ids, seq.num_prompt_tokens, seq.sampling_params, seq.index,
                    list(seq.block_table), s.start_position))
                self._worker_seqs.add(seq.seq_id)
            else:
                kept = -1
                cut = seq.block_table_cut
                if cut is not None and cut < known:  # a verify step freed surplus blocks (maybe reallocated since)
                    known = kept = cut
                step.cached_requests.append(CachedRequest(seq.seq_id, seq.block_table[known:], s.start_position,
                                                          kept))
            if s.spec_token_ids:
                step.spec_token_ids[seq.seq_id] = list(s.spec_token_ids)
            self._worker_blocks[seq.seq_id] = len(seq.block_table)
            seq.block_table_cut = None
            step.scheduled.append((seq.seq_id, s.num_scheduled_tokens))
        return step

    def _release(self, seq: Sequence) -> None:
        """The worker forgets a finished sequence (its row and generator) at the next step."""
        self._worker_blocks.pop(seq.seq_id, None)
        if self.spec_policy is not None:
            self.spec_policy.forget(seq.seq_id)
        if seq.seq_id in self._worker_seqs:
            self._worker_seqs.discard(seq.seq_id)
            self._finished_seq_ids.append(seq.seq_id)

    def _make_output(self, req: _Request) -> RequestOutput:
        completions = []
        for seq in req.seqs:
            n_before = seq.num_reported_tokens
            completions.append(CompletionOutput(
                index=seq.index,
                text=seq.output_text,
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if seq.sampling_params.logprobs is not None else None,
                logprobs=list(seq.output_logprobs) if seq.sampling_params.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                text_delta=emittable_text(seq),
                num_new_tokens=seq.num_output_tokens - n_before,
            ))
            seq.num_reported_tokens = seq.num_output_tokens
        first = req.seqs[0]
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=min((s.first_token_time for s in req.seqs if s.first_token_time), default=None),
            finished_time=max((s.finished_time or 0.0 for s in req.seqs), default=None),
            token_times=list(first.token_times),
        )
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions,
                             finished=all(s.is_finished for s in req.seqs), metrics=metrics, error=req.error,
                             prompt_logprobs=req.prompt_logprobs)

    # ------------------------------------------------------------------------------ helpers

    def run_to_completion(self, request_ids: Seq[str], progress: Any = None) -> dict[str, RequestOutput]:
        """Step until the given requests finish; returns their final outputs."""
        pending = set(request_ids)
        final: dict[str, RequestOutput] = {}
        while pending and self.has_unfinished_requests():
            for ro in self.step():
                if ro.finished and ro.request_id in pending:
                    final[ro.request_id] = ro
                    pending.discard(ro.request_id)
                    if progress is not None:
                        progress.update(1)
        return final
