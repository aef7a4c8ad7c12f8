"""Stages: how a worker runs its share of a step's forward pass, and how the step's result reaches it.

``LocalStage`` is the whole model in one process (pipeline size 1): the step's flat batch, then a CUDA graph
for decode-only steps that fit one, else eager. ``PipelineStage`` is one stage of a pipeline (GPipe; Huang
et al. 2019): micro-batches, the send/recv of (hidden, residual) between stages, and the last stage's
broadcast of the step's output. The worker holds one stage (``make_stage``) and does not branch on the
pipeline size.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from roofline.step import StepInput, StepOutput


class LocalStage:
    """The whole model (see the module docstring)."""

    is_first = True

    def __init__(self, worker: Any):
        # A weak proxy: the worker owns its stage, and a strong back-reference would make the pair a cycle that
        # only the cyclic collector frees (with, on a GPU, the whole KV pool).
        self.worker = weakref.proxy(worker)

    def forward(self, step: StepInput) -> tuple[torch.Tensor | None, np.ndarray, np.ndarray]:
        """Hidden states [T, H] of the step, the rows that sample and their flat logits indices."""
        w = self.worker
        input_ids, positions, meta, sample_rows, logits_indices = w.prepare_inputs(step)
        if w.cpu_plan is not None and w.cpu_plan.takes(meta):  # the CPU's one-call step (decode, verify passes)
            return w.cpu_plan.run(input_ids, positions, meta), sample_rows, logits_indices
        if w.graphs is not None and meta.is_decode_only and w.graphs.can_run(meta.num_seqs, meta.block_tables.shape[1],
                                                                             tree=meta.tree_lo is not None):
            return w.graphs.run(input_ids, positions, meta), sample_rows, logits_indices
        return w.model(input_ids, positions, meta), sample_rows, logits_indices

    def result(self, pending: Any) -> StepOutput:
        """The step's output, from this process's sampled ids (``PendingStep.collect``)."""
        return pending.collect()

    def probe_input(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What a timing probe feeds this stage besides token ids: nothing (it embeds)."""
        return None


class PipelineStage(LocalStage):
    """One pipeline stage (see the module docstring)."""

    def __init__(self, worker: Any):
        super().__init__(worker)
        self.ps = worker.pp
        self.is_first = self.ps.is_first_stage

    def forward(self, step: StepInput) -> tuple[torch.Tensor | None, np.ndarray, np.ndarray]:
        """This stage's share of the step, as up to ``pp_size`` micro-batches (consecutive requests, balanced
        by tokens). Each micro-batch receives the previous stage's (hidden, residual) [2, T_m, H], runs this
        stage's layers and sends its own on; the stages being separate processes, stage s works on
        micro-batch m while stage s + 1 works on m - 1, so a step keeps m / (m + p - 1) of the pipeline busy.
        Sends are non-blocking and complete before the step returns.

        Returns the last stage's hidden states [T, H] for the whole step (None on other stages), the rows
        that sample and their flat logits indices (every stage computes them alike)."""
        import torch.distributed as dist

        w, ps = self.worker, self.ps
        hidden_size = w.model_config.hidden_size
        sends, hiddens, rows, indices, offset = [], [], [], [], 0
        for m, group in enumerate(micro_batches(step.scheduled, ps.pp_size)):
            sub = StepInput(scheduled=group)
            input_ids, positions, meta, sample_rows, logits_indices = w.prepare_inputs(sub, tag=f"mb{m}_")
            n = len(positions)
            inter = None
            if not ps.is_first_stage:
                buf = torch.empty(2, n, hidden_size, dtype=w.dtype, device=w.device)
                dist.recv(buf, src=ps.pp_prev_rank)
                inter = (buf[0], buf[1])
            out = w.model(input_ids if ps.is_first_stage else None, positions, meta, inter)
            if ps.is_last_stage:
                hiddens.append(out)
            else:
                packed = torch.stack(out)
                sends.append((dist.isend(packed, dst=ps.pp_next_rank), packed))
            rows.append(sample_rows)
            indices.append(logits_indices + offset)
            offset += n
        for work, _ in sends:
            work.wait()
        hidden = torch.cat(hiddens) if hiddens else None
        return hidden, np.concatenate(rows), np.concatenate(indices)

    def result(self, pending: Any) -> StepOutput:
        """The last stage's output goes to every rank (a ``torch.distributed`` object broadcast), whose
        persistent batches take its sampled tokens, so stage 0 embeds them next step."""
        import torch.distributed as dist

        ps = self.ps
        box = [pending.collect() if ps.is_last_stage else None]
        dist.broadcast_object_list(box, src=ps.last_stage_rank)
        out: StepOutput = box[0]  # type: ignore[assignment]
        if not ps.is_last_stage and pending.rows:
            by_seq = dict(zip(out.seq_ids, out.sampled_token_ids, strict=True))
            sampled = [by_seq[sid][0] for sid in pending.seq_ids]
            self.worker.input_batch.write_sampled(pending.rows, pending.seq_ids, pending.positions, sampled,
                                                  pending.step_id)
        return out

    def probe_input(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A later stage times its own layers on zero activations (nothing is sent or received)."""
        if self.ps.is_first_stage:
            return None
        w = self.worker
        zeros = torch.zeros(n, w.model_config.hidden_size, dtype=w.dtype, device=w.device)
        return zeros, zeros.clone()


def make_stage(worker: Any) -> LocalStage:
    """The worker's stage: a pipeline stage when the pipeline has more than one, else the whole model."""
    return PipelineStage(worker) if worker.pp.pp_size > 1 else LocalStage(worker)


def micro_batches(scheduled: list[tuple[int, int]], n: int) -> list[list[tuple[int, int]]]:
    """Split a step's ``(seq_id, num_tokens)`` list into at most ``n`` non-empty runs of consecutive
    requests, cutting where the running token count first reaches k / n of the total (k = 1 .. n - 1)."""
    n = max(1, min(n, len(scheduled)))
    total = sum(t for _, t in scheduled)
    groups: list[list[tuple[int, int]]] = [[]]
    seen = 0
    for i, item in enumerate(scheduled):
        left = len(scheduled) - i  # this request and the ones after it
        if groups[-1] and len(groups) < n and (seen * n >= len(groups) * total or left <= n - len(groups)):
            groups.append([])
        groups[-1].append(item)
        seen += item[1]
    return groups
