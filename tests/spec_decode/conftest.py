"""Fixtures of the speculative-decoding tests: the tiny random Llama (``tiny.py``) as a config directory and as a
module-scoped engine (a module that needs another model defines its own fixtures of these names)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .tiny import COMMON, TINY


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    (path / "config.json").write_text(json.dumps(TINY))
    return path


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from roofline import LLM

    return LLM(str(tiny_dir), **COMMON)
