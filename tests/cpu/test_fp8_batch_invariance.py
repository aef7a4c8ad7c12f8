"""fp8 weights on CPU: a greedy prompt's output does not depend on its batch-mates (issue 31, item 4).

The issue's repro: "The capital of France is" alone, then 4 copies of it beside 6 other prompts of other
lengths, 24 greedy tokens, ``quantization="fp8"`` on the CPU. The fp8 GEMM scales activations per token, so
its rows are batch-invariant; decode attention must be too: a row is padded to a length that depends on its
own context only (``roofline.attention.torch_backend.decode_bucket``), not to its group's longest row, which
moved the top-2 logit gap and flipped tokens.
"""

from __future__ import annotations

import pytest

from roofline import LLM, SamplingParams

PROMPT = "The capital of France is"
OTHERS = ["Write a poem about the sea and the sky and", "1, 2, 3, 4,", "def fib(n):",
          "Once upon a time there was a very long story about", "Hello",
          "The quick brown fox jumps over the lazy dog. " * 5]


@pytest.mark.slow
def test_fp8_greedy_alone_equals_batched():
    llm = LLM(quantization="fp8", device="cpu", max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate([PROMPT] * 4 + OTHERS, params, use_tqdm=False)
    assert len(alone) == 24
    assert [o.outputs[0].token_ids for o in outs[:4]] == [alone] * 4
    # The batch really was ragged: the other prompts' outputs differ from the probe's.
    assert all(o.outputs[0].token_ids != alone for o in outs[4:])
