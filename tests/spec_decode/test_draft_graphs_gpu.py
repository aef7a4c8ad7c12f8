"""A separate draft model's passes (each catches its KV up as decode rows: a step's first often has two per
request, its later ones one) replay CUDA graphs (``DraftModel.capture_graphs``) and give the logits its eager
passes give. GPU only; random weights at the default model's shape (no checkpoint needed), bf16.
"""

from __future__ import annotations

import pytest
import torch

from roofline import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_separate_draft_decode_replays_cuda_graphs_like_eager():
    """The same greedy requests with the draft's graphs, then with them dropped (eager draft passes): every draft
    pass returns logits within a few bf16 ulps (rtol 2e-2, atol 5e-2) of the eager pass's, with the same argmax at 99% of rows or more, and
    the emitted tokens are identical (the target decides them). A batch of 3 also exercises graph padding."""
    llm = LLM(model="smollm2-135m", load_format="dummy", device="cuda", dtype="bfloat16", max_model_len=512,
              kv_cache_memory="4GiB",  # a quantized self mirrors the target's KV: an auto-sized pool refuses it
              speculative_config={"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 3,
                                  "adaptive": False})
    draft = llm.engine.worker.draft
    assert draft is not None and draft.graphs is not None
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 140 + 9 * i))} for i in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    replay = draft.graphs.run
    logits: list[torch.Tensor] = []
    replays: list[int] = []

    def keep(fn):  # record each draft pass's logits
        return lambda *a, **k: (lambda out: (logits.append(out.float().cpu()), out)[1])(fn(*a, **k))

    draft.decode = keep(draft.decode)
    draft.graphs.run = lambda ids, pos, meta: (replays.append(len(ids)), replay(ids, pos, meta))[1]

    with_graphs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    graph_logits, logits[:] = list(logits), []
    # Every draft pass replays a graph, each step's first (its catch-up as decode rows) included.
    assert replays and len(replays) == len(graph_logits), (len(replays), len(graph_logits))
    assert 3 in replays  # a padded replay (ladder size 4)

    draft.graphs = None  # eager draft passes from here
    eager = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert eager == with_graphs
    assert len(logits) == len(graph_logits)
    agree = total = 0
    for g, e in zip(graph_logits, logits, strict=True):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=2e-2, atol=5e-2)  # a few bf16 ulps: padded GEMMs may differ
        agree += int((g.argmax(-1) == e.argmax(-1)).sum())
        total += g.shape[0]
    assert agree >= 0.99 * total, (agree, total)
