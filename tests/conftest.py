"""Shared fixtures: the real default model (SmolLM2-135M-Instruct, fp32 on CPU) and its HF oracle.

Loading costs ~10 s each, so they are session-scoped; tests must not change their state beyond running
requests to completion.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# Without CUDA the Triton kernels run under the CPU interpreter. TRITON_INTERPRET must be set before any
# kernel module is imported (the ref_ twins live beside the kernels, so CPU tests import them too).
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
