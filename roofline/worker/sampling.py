"""Logprob entries (vLLM's layout): the one place a {token id: Logprob} dict is built from the sampler's host
lists, for sampled tokens, verified tokens and prompt tokens alike."""

from __future__ import annotations

from roofline.step import Logprob


def logprob_entry(token_id: int, logprob: float, rank: int, top_ids: list[int], top_logprobs: list[float],
                  k: int) -> dict[int, Logprob]:
    """{token id: Logprob} for one position: the actual token first (its log-probability and rank, 1 = most
    likely), then the ``k`` most likely tokens (ranks 1..k) that are not it, in descending order.

    Args:
        token_id, logprob, rank: the position's token (sampled, emitted or the prompt's next token).
        top_ids, top_logprobs: the position's most likely tokens, descending (at least ``k`` of each).
        k: the request's ``logprobs`` / ``prompt_logprobs`` count, >= 0.
    """
    entry = {token_id: Logprob(logprob, rank)}
    for r, (tid, lp) in enumerate(zip(top_ids[:k], top_logprobs[:k], strict=True)):
        if tid not in entry:
            entry[tid] = Logprob(lp, r + 1)
    return entry
