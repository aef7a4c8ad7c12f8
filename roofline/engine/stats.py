"""Engine statistics: one record per step (for run statistics and the floor comparison), cumulative
counters, and the debug-level step trace."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("roofline.engine.llm_engine")  # the trace's logger, as bench/step_trace.py reads it


@dataclass
class StepRecord:
    """Timing of one engine step, kept for run statistics and the floor comparison."""

    duration_s: float
    num_seqs: int
    num_tokens: int
    is_decode_only: bool  # no prefill work: each sequence scheduled its next token and its drafts, if any
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

    def record_step(self, out: Any, duration_s: float, scheduler: Any, prefix_cache: Any) -> None:
        """A processed step (its ``SchedulerOutput``, its duration), and the scheduler's and prefix cache's
        counters as they stand after it. A speculative verify step (each sequence's next token and its drafts,
        no prefill) counts as a decode step: the run summary's mean decode step then mixes drafting steps with
        plain ones, as its ``speculative steps:`` line says (counted as not decode before 2026-12-06, a
        fixed-gamma run at 32 requests reported the plain steps of its last few requests alone: 11.5 ms, 88%
        of floor, at a mean TPOT of 86.5 ms and 1.59 tokens a verify pass)."""
        self.record(StepRecord(
            duration_s=duration_s,
            num_seqs=len(out.scheduled),
            num_tokens=out.num_batched_tokens,
            is_decode_only=out.is_decode,
            context_tokens=sum(s.start_position + s.num_scheduled_tokens for s in out.scheduled),
        ))
        self.num_preemptions = scheduler.num_preemptions
        if prefix_cache is not None:
            self.num_prefix_cache_queries = prefix_cache.num_query_tokens
            self.num_prefix_cache_hits = prefix_cache.num_hit_tokens
            self.num_prefix_cache_evictions = prefix_cache.num_evicted_blocks

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


def trace_step(out: Any, result: Any, mode: str, spec_seqs: dict[int, int], num_waiting: int, gamma: int) -> None:
    """One debug line per processed step, for finding where a run's time goes (``bench/step_trace.py``
    summarizes a log of them): when it ended (``time.perf_counter``, s), how it ran (``mode``), its decode
    and prefill work, and its speculative tokens."""
    decode = sum(1 for s in out.scheduled if s.is_decode)
    prefill = sum(s.num_scheduled_tokens for s in out.scheduled if not s.is_decode)
    accepted = sum(result.num_accepted.get(sid, 0) for sid in spec_seqs)
    logger.debug("step trace: end=%.6f mode=%s decode=%d prefill_tokens=%d spec_seqs=%d drafted=%d "
                 "accepted=%d device_ms=%.3f waiting=%d gamma=%d", time.perf_counter(), mode, decode, prefill,
                 len(spec_seqs), sum(spec_seqs.values()), accepted, result.duration_s * 1e3, num_waiting, gamma)
