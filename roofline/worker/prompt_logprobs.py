"""Prompt logprobs in the worker (``SamplingParams.prompt_logprobs``): what each prompt token's logprob was
under the model, from the logits at every prompt position a step computes.

The logits at position ``p`` predict the token at ``p + 1``, so a chunk covering positions ``[s, s + n)``
of a prompt of ``P`` tokens scores prompt tokens ``s + 1 .. min(s + n, P - 1)``: the last position of a
chunk scores the first token of the next chunk, and position ``P - 1`` (which predicts the first generated
token) scores nothing here. Token 0 is never scored (nothing predicts it).

Only the rows of requests that ask get extra logits: ``InputBatch.prompt_logprobs_rows`` holds them until
their prompt's last scored position is computed, so a step without such rows costs one empty-dict check.
Entries are for the positions the worker computes: a sequence that resumes after a preemption scores its
prompt again (the engine keeps the first copy), and one that starts past position 0 (a prefix-cache hit)
leaves the tokens before its start unscored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from roofline.layers.sampler import token_logprobs
from roofline.step import Logprob, StepInput
from roofline.worker.input_batch import InputBatch
from roofline.worker.sampling import logprob_entry

# Logits rows per slice: bounds the [rows, vocab] fp32 logits and log-softmax a long chunk would otherwise
# materialize at once (2 x 256 x 128,256 x 4 B = 263 MB for a Llama-3 vocabulary).
PROMPT_LOGPROBS_ROWS_PER_SLICE = 256


@dataclass
class PromptLogprobsPlan:
    """One step's prompt-logprob rows, fixed when the step is prepared (host arrays only).

    Per sequence ``j``: ``seq_ids[j]`` scores prompt tokens ``first_token[j] .. first_token[j] + counts[j] - 1``
    with ``ks[j]`` top alternatives each; its rows are consecutive in ``flat_indices`` / ``target_ids``.
    """

    seq_ids: list[int]
    first_token: list[int]
    counts: list[int]
    ks: list[int]
    flat_indices: np.ndarray  # [M] int64: rows of the step's hidden states [T, hidden]
    target_ids: np.ndarray  # [M] int64: the prompt token each row's logits predict

    @property
    def max_k(self) -> int:
        return max(self.ks)


def plan_prompt_logprobs(batch: InputBatch, step: StepInput) -> PromptLogprobsPlan | None:
    """The rows of this step's flat batch whose logits score a prompt token, or None when no scheduled
    sequence asks. Call after ``update_states`` and before ``num_computed_tokens`` advances (it reads each
    chunk's start there); rows whose prompt is fully scored by this step leave ``prompt_logprobs_rows``."""
    want = batch.prompt_logprobs_rows
    if not want:
        return None
    seq_ids: list[int] = []
    first: list[int] = []
    counts: list[int] = []
    ks: list[int] = []
    flat: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    offset = 0  # flat index of this chunk's first token
    for sid, n in step.scheduled:
        row = batch.row_of[sid]
        k = want.get(row)
        if k is not None:
            start = int(batch.num_computed_tokens[row])
            last = int(batch.num_prompt_tokens[row]) - 1  # positions < last predict a prompt token
            end = min(start + n, last)
            if end > start:
                seq_ids.append(sid)
                first.append(start + 1)
                counts.append(end - start)
                ks.append(k)
                flat.append(np.arange(offset, offset + end - start, dtype=np.int64))
                targets.append(batch.token_ids[row, start + 1:end + 1])
            if start + n >= last:
                del want[row]
        offset += n
    if not seq_ids:
        return None
    return PromptLogprobsPlan(seq_ids, first, counts, ks, np.concatenate(flat), np.concatenate(targets))


def compute_prompt_logprobs(
    plan: PromptLogprobsPlan,
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    to_device: Callable[[str, np.ndarray], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Launch the plan's logits, fp32 log-softmax, target logprob and rank, and top-k, slice by slice.

    Args:
        hidden: [T, hidden_size] the step's final hidden states (before the LM head).
        compute_logits: the model's LM head, [m, hidden_size] -> [m, vocab] fp32.
        to_device: the worker's host -> device copy (name, array).
    Returns:
        device tensors: ``logprobs`` [M] fp32, ``ranks`` [M] int64, ``top_ids`` [M, K] int64,
        ``top_logprobs`` [M, K] fp32 (K = ``plan.max_k``).
    """
    idx = to_device("prompt_logprobs_idx", plan.flat_indices)
    tgt = to_device("prompt_logprobs_tgt", np.ascontiguousarray(plan.target_ids))
    parts = []
    for lo in range(0, len(plan.flat_indices), PROMPT_LOGPROBS_ROWS_PER_SLICE):
        hi = lo + PROMPT_LOGPROBS_ROWS_PER_SLICE
        parts.append(token_logprobs(compute_logits(hidden[idx[lo:hi]]), tgt[lo:hi], plan.max_k))
    return {
        "logprobs": torch.cat([p.logprobs for p in parts]),  # type: ignore[misc]
        "ranks": torch.cat([p.ranks for p in parts]),  # type: ignore[misc]
        "top_ids": torch.cat([p.top_ids for p in parts]),  # type: ignore[misc]
        "top_logprobs": torch.cat([p.top_logprobs for p in parts]),  # type: ignore[misc]
    }


def collect_prompt_logprobs(plan: PromptLogprobsPlan,
                            host: dict[str, torch.Tensor]) -> dict[int, tuple[int, list[dict[int, Logprob]]]]:
    """Host tensors -> ``{seq_id: (first prompt token index, [{token id: Logprob}, ...])}``.

    Each dict holds the actual prompt token first (its rank may exceed k), then the top-k not already in it,
    ranked 1..k (vLLM's layout).
    """
    chosen, ranks = host["logprobs"].tolist(), host["ranks"].tolist()
    top_ids, top_lps = host["top_ids"].tolist(), host["top_logprobs"].tolist()
    targets = plan.target_ids.tolist()
    out: dict[int, tuple[int, list[dict[int, Logprob]]]] = {}
    i = 0
    for sid, first, m, k in zip(plan.seq_ids, plan.first_token, plan.counts, plan.ks, strict=True):
        entries = []
        for t in range(i, i + m):
            entries.append(logprob_entry(targets[t], chosen[t], ranks[t], top_ids[t], top_lps[t], k))
        out[sid] = (first, entries)
        i += m
    return out
