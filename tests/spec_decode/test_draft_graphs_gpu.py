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


def test_fused_eagle_features_come_out_of_the_target_graphs(tmp_path):
    """A fused EAGLE head (``aux_layers`` 0 and 1, random weights at the default model's shape) makes the target
    keep its residual streams before its graphs are captured: after every step (prefill eager, decode and verify
    replayed), ``aux_out``'s rows hold the streams a plain-torch pass over the sequence gives (bf16: within
    2e-2 relative; layer 0's, the embedding, exactly), and greedy output equals plain decoding's."""
    from roofline.spec_decode import features
    from roofline.spec_decode.heads import DraftHeadConfig, EagleHead, save_head

    kw = dict(model="smollm2-135m", load_format="dummy", device="cuda", dtype="bfloat16", max_model_len=512,
              kv_cache_memory="2GiB")
    plain = LLM(**kw)
    cfg = DraftHeadConfig.for_target("eagle", plain.engine.worker.model_config, aux_layers=[1, 0])
    torch.manual_seed(0)
    head = EagleHead(cfg)
    save_head(str(tmp_path), cfg, head.export())
    prompt = list(range(100, 141))
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = list(plain.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids)
    del plain
    llm = LLM(**kw, speculative_config={"method": "eagle", "model": str(tmp_path), "num_speculative_tokens": 2,
                                        "adaptive": False})
    w = llm.engine.worker
    assert w.graphs is not None and w.model.model.aux_layers == (1, 0)
    assert w.model.model.aux_slots.tolist() == [1, 0] + [-1] * 28
    seen: list[torch.Tensor] = []
    forward = w.stage.forward

    def spy(step):
        out = forward(step)
        seen.append(w.model.model.aux_out[:out[0].shape[0]].float().cpu())
        return out

    w.stage.forward = spy
    got = list(llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids)
    assert got == ref
    (full,) = features.batched_target_features(llm, [(prompt + got, len(prompt))], aux_layers=(1, 0))
    full = full.float().cpu()[:, 576:]
    # The prefill's rows are the prompt's; a decode step's first row is the position after the tokens so far.
    torch.testing.assert_close(seen[0], full[:len(prompt)], rtol=2e-2, atol=2e-2)
    assert torch.equal(seen[0][:, 576:], full[:len(prompt), 576:])
    # 1 + 2 drafts per step; near max_tokens the controller drafts fewer (no draft past the last token).
    rows = [len(s) for s in seen[1:]]
    assert len(rows) > 2 and rows[0] == 3 and all(1 <= r <= 3 for r in rows), rows
    assert rows == sorted(rows, reverse=True), rows
    # A verify step's first row is the last emitted token, at the position after the tokens before it: the
    # stream there is the full sequence's (later rows read drafts, which may have been rejected).
    last = len(prompt) - 1
    for s in seen[1:]:
        dist = (full[last + 1:, :576] - s[0, :576]).abs().amax(-1)
        p = last + 1 + int(dist.argmin())
        torch.testing.assert_close(s[0], full[p], rtol=2e-2, atol=2e-2)
        assert torch.equal(s[0, 576:], full[p, 576:])
        last = p
    assert last > len(prompt)
