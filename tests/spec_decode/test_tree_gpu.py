"""Token trees on the GPU: the verify pass as decode rows with the ancestor mask, replayed from the CUDA graphs
(``ROOFLINE_TREE_VERIFY=decode``, the default) or through the Triton prefill kernel's mask (``=prefill``), and
EAGLE's tree drafting. Random weights at the default model's shape with random-weight heads (greedy identity
does not depend on the head's quality)."""

from __future__ import annotations

import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.spec_decode.heads import DraftHeadConfig, save_head

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _random_head(tmp_path, method, mc, seed=0):
    """A head directory of ``method`` with random weights at ``mc``'s shapes (the tests' greedy identity does not
    depend on its quality)."""
    cfg = DraftHeadConfig.for_target(method, mc, num_heads=3 if method == "medusa" else 0)
    h, i = mc.hidden_size, mc.intermediate_size
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    shapes = ({"fc.weight": (h, 2 * h), "fc.bias": (h,), "layer.input_layernorm.weight": (h,),
               "layer.post_attention_layernorm.weight": (h,), "layer.self_attn.q_proj.weight": (q, h),
               "layer.self_attn.k_proj.weight": (kv, h), "layer.self_attn.v_proj.weight": (kv, h),
               "layer.self_attn.o_proj.weight": (h, q), "layer.mlp.gate_proj.weight": (i, h),
               "layer.mlp.up_proj.weight": (i, h), "layer.mlp.down_proj.weight": (h, i)}
              if method == "eagle" else {f"heads.{k}.{n}": s for k in range(3)
                                         for n, s in (("weight", (h, h)), ("bias", (h,)))})
    g = torch.Generator().manual_seed(seed)
    d = tmp_path / method
    save_head(str(d), cfg, {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()})
    return str(d)


@pytest.mark.parametrize("verify", ["decode", "prefill"])
def test_eagle_and_medusa_trees_are_token_identical_on_the_gpu(tmp_path, monkeypatch, verify, device="cuda",
                                                               backend="triton"):
    # fp32: with =prefill the tree pass runs the prefill kernel where plain decoding runs the decode kernel; in bf16
    # their rounding differs enough to flip near-ties of random weights (decode rows: the test below, in bf16).
    monkeypatch.setenv("ROOFLINE_TREE_VERIFY", verify)
    kw = dict(model="smollm2-135m", load_format="dummy", device=device, dtype="float32", max_model_len=512,
              kv_cache_memory="2GiB", attention_backend=backend)
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 140 + 9 * i))} for i in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(**kw)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    mc = plain.engine.worker.model_config
    for method in ("eagle", "medusa"):
        _random_head(tmp_path, method, mc)
        spec = {"method": method, "model": str(tmp_path / method), "num_speculative_tokens": 3, "tree_topk": 3,
                "tree_budget": 10, "adaptive": False}
        llm = LLM(speculative_config=spec, **kw)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert got == ref, method
        assert llm.engine.spec_stats.num_drafts > 0


def test_bf16_tree_verified_as_decode_rows_is_token_identical():
    """``ROOFLINE_TREE_VERIFY=decode`` (the default): a tree's nodes are verified as decode rows (the decode kernel
    with the ancestor mask) replayed from the CUDA graphs, so in bf16 the verify pass runs plain decoding's
    arithmetic: attention by the same kernel, and with a tree of 3 nodes (4 rows) the linears on the M <= 4 GEMV,
    whose rows do not depend on M (as a chain's verify rows, greedy-identical in bf16 on an H100:
    bench/results/eagle-h100-20261205/). The prefill form was identical to plain on 1 of 8 real prompts there.
    Plain steps of the tree engine replay the same graphs with every key visible."""
    kw = dict(model="smollm2-135m", load_format="dummy", device="cuda", dtype="bfloat16", max_model_len=512,
              kv_cache_memory="2GiB", attention_backend="triton")
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 140 + 9 * i))} for i in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = LLM(**kw)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": 1, "adaptive": False}  # no tree: the chain control
    chain = LLM(speculative_config=spec, **kw)
    assert [o.outputs[0].token_ids for o in chain.generate(prompts, sp, use_tqdm=False)] == ref
    mc = plain.engine.worker.model_config
    cfg = DraftHeadConfig.for_target("medusa", mc, num_heads=1)
    g = torch.Generator().manual_seed(0)
    h = mc.hidden_size
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        save_head(d, cfg, {n: torch.randn(s, generator=g) * 0.02 for n, s in
                           (("heads.0.weight", (h, h)), ("heads.0.bias", (h,)))})
        llm = LLM(speculative_config={"method": "medusa", "model": d, "num_speculative_tokens": 1, "tree_topk": 3,
                                      "tree_budget": 3, "adaptive": False}, **kw)
        worker = llm.engine.worker
        assert worker.backend.tree_as_decode_rows and worker.graphs.tree_rows
        replays = []
        run = worker.graphs.run

        def counted(ids, pos, meta):
            replays.append(meta.tree_lo is not None)
            return run(ids, pos, meta)

        worker.graphs.run = counted
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert any(replays)  # tree verify steps replayed the graphs
    assert got == ref
    assert llm.engine.spec_stats.num_drafts > 0


@pytest.mark.parametrize("tree", [False, True])
def test_eagle_draft_passes_from_graphs_equal_eager(tmp_path, tree):
    """EAGLE's draft-layer passes replayed from its CUDA graphs (catch-up and chain passes as decode rows, tree
    passes as decode rows with the ancestor mask) give the eager packed pass's features: every pass of a real
    run is recomputed eagerly (the prefill form, which stores the same K/V) and compared, fp32, relative error
    below 1e-4."""
    kw = dict(model="smollm2-135m", load_format="dummy", device="cuda", dtype="float32", max_model_len=512,
              kv_cache_memory="2GiB", attention_backend="triton")
    probe = LLM(**kw)
    head = _random_head(tmp_path, "eagle", probe.engine.worker.model_config)
    del probe
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 3, "adaptive": False,
            **({"tree_topk": 3, "tree_budget": 10} if tree else {})}
    llm = LLM(speculative_config=spec, **kw)
    prop = llm.engine.worker.proposer
    assert prop.graphs is not None and prop.graphs.tree_rows == tree
    orig, errors = prop._pass, []

    def both(worker, token_rows, slot_pos, rope_pos, next_ids, feats, prefill, t=None):
        out = orig(worker, token_rows, slot_pos, rope_pos, next_ids, feats, prefill, t)
        graphs, prop.graphs = prop.graphs, None
        try:
            ref = orig(worker, token_rows, slot_pos, rope_pos, next_ids, feats, prefill, t)
        finally:
            prop.graphs = graphs
        errors.append(((out - ref).norm() / ref.norm()).item())
        return out

    prop._pass = both
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 140 + 9 * i))} for i in range(3)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert len(errors) > 10 and max(errors) < 1e-4, errors
