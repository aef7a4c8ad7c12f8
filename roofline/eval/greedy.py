"""Greedy-output agreement: does a configuration write the same text as the baseline?

Perplexity and KL average over next-token distributions; greedy agreement asks what a user sees. Each
configuration answers the same chat prompts greedily for a fixed number of tokens, and a prompt counts as
agreeing when every generated token equals the baseline's. The prompts are the first human turns of the
held-out ShareGPT pairs (``roofline.eval.data.heldout_pair_indices``, repeated prompts skipped), in the
model's chat template, kept to ``max_prompt_tokens``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

DEFAULT_GREEDY_PROMPTS = 64
DEFAULT_GREEDY_TOKENS = 64
DEFAULT_MAX_PROMPT_TOKENS = 256


def greedy_prompts(llm: Any, num_prompts: int, max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS) -> list[list[int]]:
    """``num_prompts`` chat-templated prompts (token ids, each <= ``max_prompt_tokens``) from the held-out pairs.

    Raises:
        ValueError: num_prompts < 1, or the slice runs out of short enough prompts.
    """
    from roofline.bench.datasets import load_sharegpt_conversations
    from roofline.eval.data import heldout_pair_indices

    if num_prompts < 1:
        raise ValueError(f"the greedy check needs >= 1 prompt, got {num_prompts}")
    pairs = load_sharegpt_conversations()
    counts = Counter(h for h, _ in pairs)
    prompts: list[list[int]] = []
    for idx in heldout_pair_indices(len(pairs)):
        human = pairs[idx][0]
        if counts[human] > 1 or not human.strip():
            continue
        ids = llm.apply_chat_template([{"role": "user", "content": human}])
        if len(ids) <= max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == num_prompts:
            return prompts
    raise ValueError(f"only {len(prompts)} held-out prompts fit in {max_prompt_tokens} tokens, asked for {num_prompts}")


def greedy_outputs(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation (up to ``max_tokens`` tokens, stopping at EOS) as token ids."""
    from roofline.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(baseline: list[list[int]], candidate: list[list[int]]) -> dict[str, float]:
    """``greedy_identical``: the fraction of prompts whose whole output equals the baseline's;
    ``greedy_prefix``: the mean fraction of the baseline's tokens generated before the first difference."""
    same = sum(b == c for b, c in zip(baseline, candidate, strict=True))
    prefix = []
    for b, c in zip(baseline, candidate, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(b, c, strict=False)) if x != y), min(len(b), len(c)))
        prefix.append(n / max(len(b), 1) if b != c else 1.0)
    return {"greedy_identical": same / len(baseline), "greedy_prefix": sum(prefix) / len(prefix)}
