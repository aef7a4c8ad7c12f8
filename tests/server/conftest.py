"""A real engine (SmolLM2-135M-Instruct on CPU) shared by the server tests, and live servers on it.

The engine loads once per session (~10-30 s); each test module starts its own uvicorn server(s) on a free
127.0.0.1 port over it. ``max_num_seqs=8`` keeps batches small and makes waiting requests easy to create
(admission control); ``max_model_len=1024`` keeps the KV cache small.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 8


@pytest.fixture(scope="session")
def async_engine():
    from roofline.args import EngineArgs
    from roofline.server.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, device="cpu", dtype="float32"))
    engine.start()
    yield engine
    engine.stop()

