"""A sequence: one sample stream of one request, with the scheduler's bookkeeping. No torch here."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from roofline.sampling_params import SamplingParams
from roofline.step import Logprob

__all__ = ["Logprob", "Sequence", "SequenceStatus"]  # Logprob lives in roofline.step; re-exported here


class SequenceStatus(IntEnum):
    """Ordered: every status >= FINISHED_STOPPED is terminal."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # failed by the worker (StepOutput.errors), e.g. a non-finite sampling distribution

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            SequenceStatus.FINISHED_STOPPED: "stop",
            SequenceStatus.FINISHED_LENGTH: "length",
            SequenceStatus.FINISHED_ABORTED: "abort",
            SequenceStatus.FINISHED_ERROR: "error",
        }.get(self)


_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """Token ids, progress and KV blocks of one sample stream.

    Invariant: ``num_computed_tokens <= num_tokens + num_placeholders``. A step that brings
    ``num_computed_tokens`` up to that total produces logits for the next token, so the sequence samples
    in that step. The scheduler advances ``num_computed_tokens`` when it schedules a chunk (so the next step
    can be scheduled while this one runs) and the engine appends the sampled tokens when they arrive.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    index: int = 0  # which of the request's n samples
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=lambda: next(_seq_counter))

    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens being sampled by a step in flight (overlapped scheduling): counted as known for scheduling, and
    # appended when that step's result arrives.
    num_placeholders: int = 0
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # Prefix caching (see Scheduler): tokens whose KV a completed step has written into this sequence's blocks
    # (<= num_computed_tokens, which also counts chunks in flight; reset by preemption), the radix-tree node
    # this sequence holds locked, the prompt tokens found in the cache when first admitted, whether the prompt
    # has been offered to the cache, the sample whose cached prompt this one waits for (n > 1), and (policy
    # lpm) the scheduling rounds in which sequences queued behind this one were admitted before it.
    num_completed_tokens: int = 0
    cache_node: Any = field(default=None, repr=False)
    num_cached_tokens: int = 0
    prompt_cached: bool = False
    fork_of: Sequence | None = field(default=None, repr=False)
    num_bypassed_rounds: int = 0
    stop_reason: int | str | None = None
    # Speculative decoding: drafts for the next step (set by the engine's proposer before scheduling; -1
    # entries are drafted by the worker's draft model).
    spec_token_ids: list[int] = field(default_factory=list)
    # The shortest the block table was cut to (freed surplus blocks after a verify step) since the worker last
    # heard of it; None: not cut.
    block_table_cut: int | None = None

    # Detokenization state (owned by the Detokenizer).
    output_text: str = ""
    num_emitted_chars: int = 0
    num_reported_tokens: int = 0  # tokens already reported in a RequestOutput
    prefix_offset: int = 0
    read_offset: int = 0
    # Log-probabilities of sampled tokens (only when sampling_params.logprobs is not None).
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0

    # Timing (time.monotonic seconds).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens + self.num_placeholders - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prefill(self) -> bool:
        """True while more than one token is left to compute (prompt, or recompute after preemption)."""
        return self.num_uncomputed_tokens > 1

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def append_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)
