"""Fixtures of the speculative-decoding tests: the tiny random Llama (``tiny.py``) as a config directory and as a
module-scoped engine (a module that needs another model defines its own fixtures of these names)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .tiny import CHATS, COMMON, DEFAULT, TINY


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    (path / "config.json").write_text(json.dumps(TINY))
    return path


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from roofline import LLM

    return LLM(str(tiny_dir), **COMMON)


@pytest.fixture(scope="module")
def default_greedy_ref():
    """The default model's plain greedy tokens for ``CHATS`` (48 each): what speculative runs must reproduce."""
    from roofline import LLM, SamplingParams

    return [o.outputs[0].token_ids for o in
            LLM(**DEFAULT).chat(CHATS, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)]
