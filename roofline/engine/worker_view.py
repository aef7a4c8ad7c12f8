"""What the worker knows about each sequence, so that each ``StepInput`` carries only what it does not: new
(or resumed) sequences whole, running ones' new blocks and progress, and the sequences to forget."""

from __future__ import annotations

from typing import Any

from roofline.engine.scheduler import SchedulerOutput
from roofline.step import CachedRequest, NewRequest, StepInput


class WorkerView:
    """Blocks sent per live sequence, every sequence the worker holds state for, and the sequences to tell
    it to forget at the next step."""

    def __init__(self) -> None:
        self.blocks: dict[int, int] = {}
        self.seqs: set[int] = set()
        self.finished_seq_ids: list[int] = []

    def step_input(self, out: SchedulerOutput, spec: Any = None) -> StepInput:
        """The ``StepInput`` of ``out``; ``spec`` (a ``SpecController``, or None) places its drafts."""
        step = StepInput(finished_seq_ids=self.finished_seq_ids,
                         preempted_seq_ids=[s.seq_id for s in out.preempted])
        self.finished_seq_ids = []
        for seq in out.preempted:
            self.blocks.pop(seq.seq_id, None)
        for s in out.scheduled:
            seq = s.seq
            known = self.blocks.get(seq.seq_id)
            if known is None:
                step.new_requests.append(NewRequest(
                    seq.seq_id, seq.token_ids, seq.num_prompt_tokens, seq.sampling_params, seq.index,
                    list(seq.block_table), s.start_position))
                self.seqs.add(seq.seq_id)
            else:
                kept = -1
                cut = seq.block_table_cut
                if cut is not None and cut < known:  # a verify step freed surplus blocks (maybe reallocated since)
                    known = kept = cut
                step.cached_requests.append(CachedRequest(seq.seq_id, seq.block_table[known:], s.start_position,
                                                          kept))
            if s.spec_token_ids:
                spec.add_to_step(step, seq.seq_id, s.spec_token_ids)
            self.blocks[seq.seq_id] = len(seq.block_table)
            seq.block_table_cut = None
            step.scheduled.append((seq.seq_id, s.num_scheduled_tokens))
        return step

    def release(self, seq_id: int) -> None:
        """The worker forgets a finished sequence (its row and generator) at the next step."""
        self.blocks.pop(seq_id, None)
        if seq_id in self.seqs:
            self.seqs.discard(seq_id)
            self.finished_seq_ids.append(seq_id)

    def rollback(self, step_input: StepInput) -> None:
        """A step that failed: its sequences are resent whole, and its forgotten ones told again."""
        for sid, _ in step_input.scheduled:
            self.blocks.pop(sid, None)
        self.finished_seq_ids.extend(step_input.finished_seq_ids)
