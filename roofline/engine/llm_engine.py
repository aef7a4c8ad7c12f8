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

This module imports no torch and no worker code: the executor is built outside (``roofline.engine_factory``)
and handed in; the engine sees only the ``roofline.step.Executor`` protocol.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence as Seq
from typing import Any

from roofline.config import EngineConfig, ModelConfig
from roofline.engine.block_pool import BlockPool
from roofline.engine.output_processor import OutputProcessor, RequestState
from roofline.engine.radix_cache import RadixCache
from roofline.engine.scheduler import Scheduler, SchedulerOutput
from roofline.engine.sequence import Sequence, SequenceStatus
from roofline.engine.stats import EngineStats, trace_step
from roofline.engine.worker_view import WorkerView
from roofline.outputs import RequestOutput
from roofline.sampling_params import SamplingParams
from roofline.spec_decode.controller import SpecController
from roofline.spec_decode.policy import SpecPolicy
from roofline.spec_decode.stats import SpecDecodeStats
from roofline.step import Executor, StepInput

logger = logging.getLogger(__name__)


def check_unicode(text: str, what: str) -> None:
    """Raise ValueError where ``text`` holds a lone UTF-16 surrogate (\\ud800-\\udfff), which no tokenizer can
    encode: what Python makes of non-UTF-8 bytes in a command-line argument (``surrogateescape``), or a JSON
    string's unpaired escape. The message names ``what``, the character and its index."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} contains a lone UTF-16 surrogate {text[e.start]!r} at character {e.start} "
                         f"(non-UTF-8 bytes?): not valid Unicode text") from None


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor, model_config: ModelConfig,
                 tokenizer: Any = None):
        """``executor`` runs the model (``roofline.engine_factory.build_engine`` starts the one ``config`` asks
        for); the engine owns it from here on (``executor.shutdown()``)."""
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.executor = executor
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
        per_token = self.executor.kv_bytes_per_token
        self.kv_cache_summary = (
            f"KV cache: {capacity} tokens ({num_blocks} blocks of {cc.block_size}, {cc.kv_cache_dtype}, "
            f"{per_token} bytes/token, {capacity * per_token / 2**30:.2f} GiB); per-step token budget "
            f"{sc.max_num_batched_tokens}")
        logger.info("%s", self.kv_cache_summary)
        self.block_pool = BlockPool(num_blocks, cc.block_size)
        self.prefix_cache = RadixCache(self.block_pool) if cc.enable_prefix_caching else None
        self.scheduler = Scheduler(sc, self.block_pool, self.prefix_cache)
        self.output = OutputProcessor(tokenizer, sc.max_model_len)
        self.detokenizer = self.output.detokenizer
        self.requests: dict[str, RequestState] = {}
        self.stats = EngineStats()
        self.eos_token_ids = set(model_config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))
        self._ids = itertools.count()
        self._no_spec_stats = SpecDecodeStats()
        self.sent = WorkerView()  # what the worker knows of each sequence
        self._inflight: tuple[SchedulerOutput, Any] | None = None  # the launched step not yet processed
        self.spec_config = config.speculative_config
        # Speculative decoding's engine side (policy, host proposer, stats); None without speculation.
        self.spec: SpecController | None = None
        if self.spec_config is not None:
            self.spec = SpecController(self.spec_config, model_config, sc.max_model_len,
                                       self.executor.device_profile())
            self.kv_cache_summary += f"; {self.spec.summary}"

    @property
    def spec_stats(self) -> SpecDecodeStats:
        """Speculative decoding's counters (empty without speculation)."""
        return self.spec.stats if self.spec is not None else self._no_spec_stats

    @property
    def spec_policy(self) -> SpecPolicy | None:
        """The gamma policy (None without speculation)."""
        return self.spec.policy if self.spec is not None else None

    @property
    def block_manager(self) -> BlockPool:
        """The block pool under its older name (benchmarks and tests read its counts through it)."""
        return self.block_pool

    @property
    def worker(self) -> Any:
        """The executor's in-process worker (model, KV pool, device), or a rank's start-up figures: for reports
        and benchmarks only (the engine itself talks to the executor)."""
        return getattr(self.executor, "worker", None)

    # ------------------------------------------------------------------------------ requests

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of ``prompt``. Raises ValueError: no tokenizer, or text that is not valid Unicode."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights, or a GGUF file without a vocabulary); pass prompt token ids")
        check_unicode(prompt, "prompt")
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
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            what = "is a bool, not an integer token id in" if isinstance(bad[0], bool) else "is out of range"
            raise ValueError(f"prompt token id {bad[0]!r} {what} [0, {vocab})")
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
        self.requests[request_id] = RequestState(request_id, text, token_ids, seqs, now, stream,
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
        asynchronous (or, without async scheduling, plain synchronous steps, timed as the policy's plain steps)
        and propose nothing, until a probe is due or a new request joins a small batch; with the
        adaptive policy a step that will carry prefill work does not draft either (``_drafting_due``;
        ``SpecPolicy.drafting_due``). The first async step after a drafting step launches with none in flight:
        its host time is charged to the drafting step (``SpecPolicy.record_refill``).
        """
        if self.spec is not None and self._drafting_due():
            self.spec.refill = None
            done = self._drain()
            t0 = time.perf_counter()
            self.spec.propose(self.scheduler.running, self.scheduler.num_waiting)
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
        if self.spec is not None:
            self._skip_drafting()
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        pending = self._launch(out) if not out.is_empty else None
        if not self.config.async_scheduling and pending is not None:
            # Timed for the speculative policy (a plain step's period) when decode-only.
            return self._process(out, pending, wall_t0=t0 if out.is_decode_only else None, mode="sync")
        prev, self._inflight = self._inflight, ((out, pending) if pending is not None else None)
        refill = None
        if self.spec is not None:
            refill, self.spec.refill = self.spec.refill, None
        if prev is None and refill is not None and pending is not None:
            assert self.spec is not None  # the async step after a drafting one (SpecController.record_refill)
            self.spec.record_refill(refill, time.perf_counter() - t0)
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
        """Whether this step proposes drafts, and so runs synchronously (``SpecController.drafting_due``)."""
        assert self.spec is not None
        return self.spec.drafting_due(self.scheduler.running, self.scheduler.num_waiting)

    def _skip_drafting(self) -> None:
        """A step run without drafts (``SpecController.skip``)."""
        assert self.spec is not None
        self.spec.skip(self.scheduler.running)

    def _launch(self, out: SchedulerOutput) -> Any:
        step_input = self._step_input(out)
        try:
            return self.executor.execute_model_async(step_input)
        except BaseException:
            self._rollback(out, step_input)
            raise

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
        self.stats.record_step(out, result.duration_s, self.scheduler, self.prefix_cache)
        sampled = dict(zip(result.seq_ids, result.sampled_token_ids, strict=True))
        logprobs = {sid: lps for sid, lps in zip(result.seq_ids, result.logprobs, strict=True) if lps}
        if result.prompt_logprobs:
            self.output.add_prompt_logprobs(self.requests, {s.seq.seq_id: s.seq for s in out.scheduled},
                                            result.prompt_logprobs)
        spec_seqs = {s.seq.seq_id: len(s.spec_token_ids) for s in out.scheduled if s.spec_token_ids}
        if spec_seqs:
            assert self.spec is not None
            self.spec.record(spec_seqs, result)
        failed = self._fail_requests({s.seq.request_id: result.errors[str(s.seq.seq_id)] for s in out.scheduled
                                      if str(s.seq.seq_id) in result.errors}) if result.errors else []
        # A steady-state step of decodes only (no prefill chunk; not one drained before a drafting step, whose
        # launch-to-result time is not a step period) teaches the policy the measured verify ratio, timed below.
        timed = self.spec is not None and wall_t0 is not None and out.is_decode
        changed = self.scheduler.update(out, sampled)
        touched: dict[str, RequestState] = {}
        now = time.monotonic()
        for seq in changed:
            # A verify step's tokens are appended here one at a time, each checked as a step's single token is.
            new = sampled[seq.seq_id] if seq.seq_id in spec_seqs else [seq.output_token_ids[-1]]
            for i, token in enumerate(new):
                if seq.seq_id in spec_seqs:
                    seq.append_token(token, now)
                lps = logprobs.get(seq.seq_id)
                if lps is not None:
                    self.output.add_logprob(seq, token, lps[i] if seq.seq_id in spec_seqs else lps[-1])
                status = self.output.check_stops(seq, token)
                if status is not None:
                    self.scheduler.finish(seq, status)
                    self._release(seq)
                    break
            req = self.requests.get(seq.request_id)
            if req is not None:
                touched[req.request_id] = req
        outputs = failed
        for req in touched.values():
            if not req.stream and not all(s.is_finished for s in req.seqs):
                continue
            ro = self.output.make_output(req)
            outputs.append(ro)
            if ro.finished:
                del self.requests[req.request_id]
        if timed:
            assert self.spec is not None and wall_t0 is not None
            self.spec.record_step(len(out.scheduled), spec_seqs, wall_t0, result, mode)
        if logger.isEnabledFor(logging.DEBUG):
            trace_step(out, result, mode, spec_seqs, self.scheduler.num_waiting, self.spec_stats.gamma)
        return outputs

    def _fail_requests(self, errors: dict[str, str]) -> list[RequestOutput]:
        """Finish each request named in ``errors`` (request id -> message, from ``StepOutput.errors``) with that
        error: its sequences end with status ``FINISHED_ERROR`` and their blocks are freed now (this step's tokens for them are dropped).
        Returns their final outputs, each with ``error`` set."""
        outputs = []
        for request_id, message in errors.items():
            req = self.requests.pop(request_id, None)
            if req is None:
                continue  # finished or aborted meanwhile
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
                    self._release(seq)
            logger.warning("request %s failed: %s", request_id, message)
            ro = self.output.make_output(req)
            ro.error = message
            outputs.append(ro)
        return outputs

    def _step_input(self, out: SchedulerOutput) -> StepInput:
        """Tell the worker only what it does not know (``WorkerView.step_input``)."""
        return self.sent.step_input(out, self.spec)

    def _release(self, seq: Sequence) -> None:
        """The worker forgets a finished sequence at the next step; so does the speculative policy."""
        self.sent.release(seq.seq_id)
        if self.spec is not None:
            self.spec.forget(seq.seq_id)

    def _rollback(self, out: SchedulerOutput, step_input: StepInput) -> None:
        """A step that failed: undo its progress, and resend its sequences whole to the worker."""
        for s in out.scheduled:
            s.seq.num_computed_tokens = s.start_position
            if s.samples:
                s.seq.num_placeholders -= 1
        self.sent.rollback(step_input)

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
