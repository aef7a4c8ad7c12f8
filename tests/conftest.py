"""Shared fixtures: the real default model (SmolLM2-135M-Instruct, fp32 on CPU) and its HF oracle.

Loading costs ~10 s each, so they are session-scoped; tests must not change their state beyond running
requests to completion.
"""

from __future__ import annotations

import os

# Before anything imports torch, as the CLI does. The suite runs purely passive OpenMP threads (GOMP_SPINCOUNT=0;
# roofline's own default spins 100,000 times first and re-sizes the pool with the load, roofline.cpu): every
# engine then takes all usable cores (roofline.cpu.choose_threads) instead of sampling the load. Under load
# (another job on a 2-core CI machine) that sampling picked 1 thread for some engines and 2 for others, and torch's
# CPU kernels round differently with the thread count: the int8 KV cache's batched-vs-alone identity
# (tests/test_kv_cache_dtype.py) failed at 1 thread on the Xeon of 2026-12-04.
os.environ.setdefault("GOMP_SPINCOUNT", "0")
import roofline  # noqa: F401, I001

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# Without CUDA the Triton kernels run under the CPU interpreter. TRITON_INTERPRET must be set before any
# kernel module is imported (the ref_ twins live beside the kernels, so CPU tests import them too).
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def _reuse_dequantized_gguf():
    """Dequantizing the default model's GGUF (with the gguf package, in numpy) is ~2.3 s of each engine's ~4 s
    load on a 2-core CPU, and the suite builds dozens of engines: keep the last file's dequantized tensors for
    the session and give each load copies. A file's first load runs the real path; loads in spawned worker
    processes (tensor and pipeline parallel tests) always do."""
    from roofline.models import gguf_file

    real = gguf_file.iter_gguf
    cache: dict[tuple, list] = {}

    def iter_gguf(path, config):
        key = (str(path), os.path.getmtime(path), config.num_attention_heads, config.num_key_value_heads)
        if key not in cache:
            cache.clear()
            cache[key] = list(real(path, config))
        for name, tensor in cache[key]:
            yield name, tensor.clone()

    gguf_file.iter_gguf = iter_gguf
    yield
    gguf_file.iter_gguf = real


@pytest.fixture(scope="session")
def default_llm():
    from roofline import LLM

    return LLM(max_model_len=1024, dtype="float32", device="cpu", attention_backend="torch", max_num_batched_tokens=2048)


@pytest.fixture(scope="session")
def hf_oracle():
    """transformers' own GGUF loader on the same file (needs accelerate): the reference model."""
    import torch
    from transformers import AutoModelForCausalLM

    from roofline.models.loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()
