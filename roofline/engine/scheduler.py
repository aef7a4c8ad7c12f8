"""Continuous batching under a per-step token budget. Pure Python (no torch).

One rule, as in vLLM v1: each sequence's ``num_computed_tokens`` catches up with its ``num_tokens``
within a per-step budget of ``max_num_batched_tokens``. That covers prefill, chunked prefill, decode and
recompute after preemption in one loop. Order within a step:

1. Running sequences that decode (one token each) go first, so a long prefill never starves them.
2. Running sequences still in prefill take chunks from what is left of the budget.
3. Waiting sequences are admitted first-come first-served while the budget, ``max_num_seqs`` and free
   blocks allow, unless this step already had to preempt.

When a running sequence cannot get a block, the most recently arrived running sequence is preempted by
recompute: its blocks are freed, its progress reset, and it goes back to the front of the queue.

Overlapped scheduling: ``schedule`` advances ``num_computed_tokens`` at once and counts each sampling
chunk's coming token as a placeholder, so step N+1 can be scheduled while step N runs; ``update`` appends
the real token later. A sequence whose in-flight token will end it by length is not scheduled again; one
that ends on a stop token has computed one token too many, which is dropped.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from roofline.config import SchedulerConfig
from roofline.engine.block_manager import BlockManager
from roofline.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """One sequence's chunk in a step, fixed when scheduled.

    ``start_position``: the chunk's first position (``num_computed_tokens`` before this step).
    ``samples``: the chunk reaches the end of the known tokens (placeholders included), so its last logits
    pick the next token.
    """

    seq: Sequence
    num_scheduled_tokens: int
    start_position: int = -1
    samples: bool = False

    def __post_init__(self) -> None:
        if self.start_position < 0:
            self.start_position = self.seq.num_computed_tokens
            self.samples = self.num_scheduled_tokens == self.seq.num_uncomputed_tokens


@dataclass
class SchedulerOutput:
    """What the runner executes this step: sequences (decodes first) and how many tokens of each."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def is_decode_only(self) -> bool:
        return bool(self.scheduled) and all(s.num_scheduled_tokens == 1 for s in self.scheduled)


class Scheduler:
    """Mutates sequences' status, ``num_computed_tokens`` and (through the BlockManager) block tables."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------------------ queue management

    def add(self, seq: Sequence) -> None:
        """Queue a validated sequence (the engine checks lengths before this)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End ``seq`` with a terminal ``status`` and free its blocks at once."""
        assert status.is_finished
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status
        seq.finished_time = time.monotonic()
        self.block_manager.free(seq)

    # ------------------------------------------------------------------------------ the step

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        # Decodes first (one token each), then running prefills; FCFS within each group.
        order = sorted(self.running, key=lambda s: (s.is_prefill, s.arrival_time, s.seq_id))
        scheduled_ids: set[int] = set()
        preempted_ids: set[int] = set()
        for seq in order:
            if budget == 0:
                break
            if seq.seq_id in preempted_ids or self._finishes_in_flight(seq):
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.config.enable_chunked_prefill and num_new < seq.num_uncomputed_tokens:
                continue
            while not bm.can_allocate(seq, num_new):
                victim = max(
                    (s for s in self.running if s.seq_id not in scheduled_ids),
                    key=lambda s: (s.arrival_time, s.seq_id),
                )
                self._preempt(victim)
                out.preempted.append(victim)
                preempted_ids.add(victim.seq_id)
                if victim is seq:
                    break
            if seq.seq_id in preempted_ids:
                continue
            bm.allocate(seq, num_new)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                num_new = min(seq.num_uncomputed_tokens, budget)
                if not self.config.enable_chunked_prefill and num_new < seq.num_uncomputed_tokens:
                    break
                if not bm.can_allocate(seq, num_new):
                    break
                self.waiting.popleft()
                bm.allocate(seq, num_new)
                seq.status = SequenceStatus.RUNNING
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = time.monotonic()
                self.running.append(seq)
                out.scheduled.append(ScheduledSequence(seq, num_new))
                budget -= num_new
        # Progress advances now, so the next step can be scheduled before this one's tokens arrive.
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_scheduled_tokens
            if s.samples:
                s.seq.num_placeholders += 1
        return out

    def _finishes_in_flight(self, seq: Sequence) -> bool:
        """A token in flight will end ``seq`` by length (max_tokens or max_model_len): do not schedule it."""
        if not seq.num_placeholders:
            return False
        total = seq.num_tokens + seq.num_placeholders
        max_tokens = seq.sampling_params.max_tokens
        return total >= self.config.max_model_len or (
            max_tokens is not None and seq.num_output_tokens + seq.num_placeholders >= max_tokens)

    def update(self, out: SchedulerOutput, sampled: dict[int, list[int]], now: float | None = None) -> list[Sequence]:
        """Append the tokens a step sampled (``num_computed_tokens`` already advanced in ``schedule``).

        A sequence preempted after ``out`` was scheduled still gets its token (it recomputes from it).

        Args:
            sampled: seq_id -> new token ids (one per step today), for every scheduled sequence whose
                chunk samples.
        Returns:
            the sequences that received a new token (the engine checks stops on them).
        """
        now = time.monotonic() if now is None else now
        got_token = []
        for s in out.scheduled:
            seq = s.seq
            if not s.samples:
                continue
            seq.num_placeholders -= 1
            if seq.is_finished:  # finished (stop, abort) while the step ran: the token is dropped
                continue
            for token in sampled[seq.seq_id]:
                seq.append_token(token, now)
            got_token.append(seq)
        return got_token
