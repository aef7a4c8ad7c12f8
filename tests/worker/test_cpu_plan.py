"""The CPU decode plan (``roofline.worker.cpu_plan``): a decode step of the default model in one C++ call gives
the module path's hidden states bit for bit (so the same tokens and exactly the same logprobs), for each format
it takes, at one row and (bf16 with AMX or AVX-512 BF16 tiles) at several; it is used on every decode step it covers and on no other step;
it is not built where it does not apply."""

from __future__ import annotations

import pytest
import torch

from roofline.kernels import cpu_bf16, cpu_f32
from roofline.kernels import cpu_paged_attention as cpa


@pytest.fixture(autouse=True)
def _needs_the_plan(request):
    """A test of an fp32 model (its ``dtype`` parameter) needs the small-M fp32 linear (AVX-512F, or AVX2 + FMA:
    so it runs on a laptop CPU too); the others need bf16 matrix units (AVX-512 BF16 or AMX)."""
    callspec = getattr(request.node, "callspec", None)
    dtype = callspec.params.get("dtype", "bfloat16") if callspec is not None else "bfloat16"
    if cpa.unavailable_reason() is not None:
        pytest.skip("needs the C++ library")
    if dtype == "float32" and not cpu_f32.available():
        pytest.skip("needs the small-M fp32 linear (AVX-512F, or AVX2 + FMA)")
    if dtype != "float32" and not cpu_bf16._cpu_has_bf16_units():
        pytest.skip("needs AVX-512 BF16 / AMX")


class _Counting:
    """The plan's library with its one entry point counted."""

    def __init__(self, lib):
        self.lib, self.calls = lib, 0

    def roofline_decode_step(self, *args):
        self.calls += 1
        return self.lib.roofline_decode_step(*args)

    def roofline_decode_step_f32(self, *args):
        self.calls += 1
        return self.lib.roofline_decode_step_f32(*args)


def _same(outs, refs):
    for got, ref in zip(outs, refs, strict=True):
        got, ref = got.outputs[0], ref.outputs[0]
        assert got.token_ids == ref.token_ids
        for a, b in zip(got.logprobs, ref.logprobs, strict=True):  # every step's top-3 logprobs, exactly
            assert {t: lp.logprob for t, lp in a.items()} == {t: lp.logprob for t, lp in b.items()}


@pytest.mark.parametrize("dtype,kv,quantization", [("bfloat16", "float32", None), ("bfloat16", "bfloat16", None),
                                                  ("bfloat16", "auto", "int8"), ("float32", "auto", None)])
def test_plan_is_bit_identical_to_the_modules(dtype, kv, quantization):
    from roofline import LLM, SamplingParams

    llm = LLM(device="cpu", dtype=dtype, kv_cache_dtype=kv, quantization=quantization, max_model_len=512)
    worker = llm.engine.worker
    plan = worker.cpu_plan
    assert plan is not None or dtype != "float32", "the fp32 linear runs here, so the fp32 plan must be built"
    if plan is None:
        pytest.skip("the plan does not apply on this CPU (no AVX-512 VNNI / BF16 GEMVs)")
    multi = plan.max_rows > 1
    from roofline.kernels.cpu_int8 import amx_int8_available, vnni_int8_available

    if dtype == "float32":  # the small-M fp32 linear: rows independent of M, up to its MAX_ROWS
        from roofline.kernels.cpu_f32 import MAX_ROWS

        assert plan.max_rows == MAX_ROWS and plan.dtype == torch.float32
    else:
        assert multi == (cpu_bf16.tiles_available() and (quantization is None or amx_int8_available()
                                                         or vnni_int8_available()))
        if multi and quantization is None:
            assert plan.max_rows == cpu_bf16.TILE_MAX_ROWS
    if worker.cpu_summary is not None:
        assert worker.cpu_summary.endswith(f"CPU decode plan: on ({plan.describe()})")
        assert (f"1-{plan.max_rows} rows" in plan.describe()) == multi
    plan.lib = counting = _Counting(plan.lib)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n): # a longer prompt, in two blocks"]
    got = llm.generate(prompts[:1], sp, use_tqdm=False)
    assert counting.calls == 23  # every decode step of the one row (the first token comes from the prefill)
    batch = llm.generate(prompts, sp, use_tqdm=False)  # one prefill step, then 23 decode steps of three rows
    assert counting.calls == (46 if multi else 23)  # INT8 without AMX-INT8: the plan takes one row, the modules run
    worker.cpu_plan = None
    _same(got, llm.generate(prompts[:1], sp, use_tqdm=False))
    _same(batch, llm.generate(prompts, sp, use_tqdm=False))
    # batch-invariant: with tiles (AMX or AVX-512 BF16) a row's bits do not depend on the rows beside it, so the row
    # in a batch of three gave the one-row plan's tokens and logprobs exactly; otherwise (one-row GEMVs) its first
    # tokens
    if multi:
        _same(batch[:1], got)
    else:
        assert batch[0].outputs[0].token_ids[:8] == got[0].outputs[0].token_ids[:8]


def test_plan_is_not_built_where_it_does_not_apply(monkeypatch, caplog):
    import logging

    from roofline import LLM
    from roofline.worker import cpu_plan

    with caplog.at_level(logging.INFO, logger="roofline.worker.worker"):
        # an fp16 model: no C++ pieces for it, the modules run
        llm = LLM(device="cpu", dtype="float16", max_model_len=256, load_format="dummy")
    assert llm.engine.worker.cpu_plan is None
    assert "CPU decode plan: off (cpu torch.float16, not a bf16 or fp32 model on CPU)" in caplog.text
    # the start-up summary `roofline generate` prints says so
    assert llm.engine.worker.cpu_summary.endswith(
        "CPU decode plan: off (cpu torch.float16, not a bf16 or fp32 model on CPU)")
    llm = LLM(device="cpu", dtype="float32", max_model_len=256, kv_cache_dtype="bfloat16")
    assert llm.engine.worker.cpu_plan is None
    monkeypatch.setattr(cpu_plan, "ENABLED", False)
    worker = llm.engine.worker
    assert cpu_plan.CpuDecodePlan.build(worker.model, worker.backend, torch.float32,
                                        torch.device("cpu")) == (None, "ROOFLINE_CPU_PLAN=0")
    monkeypatch.setattr(cpu_plan, "ENABLED", True)
    assert cpu_plan.CpuDecodePlan.build(worker.model, worker.backend, torch.float32,
                                        torch.device("cpu")) == (None, "an fp32 model with a bf16 KV cache")
    # an fp32 model's modules asked for as bf16: refused at its first fp32 part, naming it
    assert cpu_plan.CpuDecodePlan.build(worker.model, worker.backend, torch.bfloat16,
                                        torch.device("cpu")) == (None, "norm weights not bfloat16")


def test_plan_names_the_cache_it_cannot_read(caplog):
    """A block size the C++ attention does not take (> 64): the modules run, and the log names the block size."""
    import logging

    from roofline import LLM, SamplingParams

    with caplog.at_level(logging.INFO, logger="roofline.worker.worker"):
        llm = LLM(device="cpu", dtype="bfloat16", block_size=128, max_model_len=256)
    assert llm.engine.worker.cpu_plan is None
    assert "block size 128" in caplog.text and "blocks of <= 64 tokens" in caplog.text
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_tree_rows_see_exactly_the_reference_mask():
    """A tree verify step's decode rows (``tree_decode_rows``, the CPU plan's and the Triton backend's): for every query row, the keys its length,
    ``tree_lo`` and ``tree_bits`` let it see are the row of ``tree_visibility`` (the prefill path's rule), for a
    tree with the root in its region, one wider than the mask (the root before it), a plain decode row beside
    them, and a sequence whose region starts at key 0."""
    import numpy as np

    from roofline.attention.backend import paged_metadata, tree_decode_rows, tree_visibility
    from roofline.spec_decode.tree import DraftTree, region_mask

    trees = [DraftTree(tokens=np.arange(5), parents=np.array([-1, -1, 0, 1, 2]), depth=np.array([1, 1, 2, 2, 3])),
             DraftTree(tokens=np.arange(4), parents=np.array([-1, 0, 0, 1]), depth=np.array([1, 2, 2, 3])), None,
             DraftTree(tokens=np.arange(3), parents=np.array([-1, -1, 0]), depth=np.array([1, 1, 2]))]
    q = np.array([6, 5, 1, 4])
    lens = np.array([40, 21, 9, 4])
    width = 5  # the second tree (4 nodes + root = 5 rows) fills it; the first (6 rows) keeps its root outside
    mask = np.stack([region_mask(t, width) if t is not None else np.full(width, -1) for t in trees])
    qsl = np.concatenate([[0], np.cumsum(q)])
    tables = np.arange(4 * 3, dtype=np.int32).reshape(4, 3)
    meta = paged_metadata(np.zeros(q.sum(), dtype=np.int64), qsl, lens, tables, torch.device("cpu"), mask)
    table, row_lens, lo, bits = tree_decode_rows(meta, int(q.sum()))
    assert tree_decode_rows(meta, int(q.sum()) + 1) is None  # rows that do not add up: declined
    assert torch.equal(table, torch.from_numpy(np.repeat(tables, q, axis=0)))
    row = 0
    for i in range(4):
        want = tree_visibility(torch.from_numpy(mask[i]), int(q[i]), int(lens[i]))  # [q_i, L_i]
        for t in range(q[i]):
            n, b, lo_t = int(row_lens[row]), int(bits[row]), int(lo[row])
            seen = [k < n and (k < lo_t or b == -1 or bool((b >> (k - lo_t)) & 1)) for k in range(lens[i])]
            assert seen == want[t].tolist(), (i, t)
            row += 1
    assert int(lo[-1]) == 0 and int(bits[-1]) & 1  # the last sequence's region starts at key 0, which it sees


@pytest.mark.parametrize("spec,quantization,dtype", [
    ({"method": "eagle", "num_speculative_tokens": 2, "tree_topk": 3, "tree_budget": 6}, None, "bfloat16"),
    ({"method": "medusa", "num_speculative_tokens": 2, "tree_topk": 3, "tree_budget": 6}, None, "bfloat16"),
    ({"method": "eagle", "num_speculative_tokens": 2}, None, "bfloat16"),  # a chain: its verify rows are decode rows
    ({"method": "eagle", "num_speculative_tokens": 2, "tree_topk": 3, "tree_budget": 6}, "int8", "bfloat16"),
    ({"method": "eagle", "num_speculative_tokens": 2, "tree_topk": 3, "tree_budget": 6}, None, "float32"),
])
def test_verify_passes_run_in_the_plan_and_keep_greedy_output_bit_exact(spec, quantization, dtype):
    """Speculation on a bf16 model: every verify pass runs in the plan (a token tree as decode rows whose attention
    sees each node's path as a chain would), and the greedy output equals plain decoding's token for token: the
    AMX GEMM's rows do not depend on M, and a node's attention is its path's decode row bit for bit."""
    from roofline import LLM, SamplingParams

    spec = dict(spec, adaptive=False)
    llm = LLM(device="cpu", dtype=dtype, max_model_len=512, speculative_config=spec, quantization=quantization)
    plan = llm.engine.worker.cpu_plan
    assert dtype != "float32" or (plan is not None and plan.max_rows > 1), "the fp32 plan takes verify rows here"
    if plan is None or plan.max_rows == 1:
        pytest.skip("the plan takes one row here (INT8 W8A8 without AMX-INT8 tiles): verify passes run the modules")
    trees = {"steps": 0}
    run = plan.run

    def counted(ids, pos, meta):
        trees["steps"] += meta.tree_mask is not None
        return run(ids, pos, meta)

    plan.run = counted
    plan.lib = counting = _Counting(plan.lib)
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
               "Explain why the sky is blue in two sentences."]
    got = llm.generate(prompts, sp, use_tqdm=False)
    steps = llm.engine.spec_stats.num_steps_on
    assert steps > 10 and trees["steps"] == (steps if "tree_topk" in spec else 0)
    assert counting.calls >= steps  # every verify pass reached the C++ call
    assert llm.engine.spec_stats.num_accepted_tokens >= 5  # drafted nodes were accepted, not only the roots
    ref = LLM(device="cpu", dtype=dtype, max_model_len=512, quantization=quantization).generate(
        prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


def test_a_tree_step_of_more_than_64_rows_stays_in_the_plan():
    """Ten requests verifying 7-node trees are 70 rows a step: past the old 64-row limit of the AVX-512 tile kernels,
    where the step fell back to the modules' prefill-form tree attention and bf16 greedy output drifted from plain
    decoding (a fresh-user run, 2026-12-07). Every tile kernel now takes 256 rows, as the AMX ones do."""
    from roofline import LLM, SamplingParams

    spec = {"method": "eagle", "num_speculative_tokens": 2, "tree_topk": 3, "tree_budget": 6, "adaptive": False}
    kw = dict(device="cpu", dtype="bfloat16", max_model_len=256, max_num_seqs=16, enable_prefix_caching=False)
    llm = LLM(speculative_config=spec, **kw)
    plan = llm.engine.worker.cpu_plan
    if plan is None or not cpu_bf16.tiles_available():
        pytest.skip("no multi-row CPU plan on this CPU (no AVX-512 BF16 or AMX tiles)")
    assert plan.max_rows == 256
    rows = []
    run = plan.run

    def counted(ids, pos, meta):
        rows.append(sum(meta.query_lens_cpu) if meta.tree_mask is not None else 0)
        return run(ids, pos, meta)

    plan.run = counted
    prompts = [f"Tell me fact number {i} about the ocean." for i in range(10)]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert max(rows) == 70  # every request's tree in one step, through the plan
    want = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, sp, use_tqdm=False)]
    assert got == want


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_eagle_draft_layer_runs_in_the_plan_close_to_its_modules(dtype):
    """The EAGLE draft layer's decode-row passes (the step's first pass and the tree's) run in one C++ call each,
    without the target's embedding and final norm (the layer's output plus its residual): bit-identical to the
    layer's modules on the same tokens (which attend in the packed prefill form), and greedy output stays plain
    decoding's."""
    import numpy as np

    from roofline import LLM, SamplingParams

    spec = {"method": "eagle", "num_speculative_tokens": 2, "tree_topk": 3, "tree_budget": 6, "adaptive": False}
    llm = LLM(device="cpu", dtype=dtype, max_model_len=512, speculative_config=spec)
    worker = llm.engine.worker
    prop = worker.proposer
    assert dtype != "float32" or (prop.cpu_plan is not None and prop.cpu_plan.max_rows > 1), \
        "the fp32 plan runs EAGLE's draft layer here"
    if prop.cpu_plan is None or prop.cpu_plan.max_rows == 1:
        pytest.skip("no multi-row CPU plan on this CPU (no AVX-512 BF16 or AMX tiles)")
    calls = {"n": 0, "trees": 0}
    run_rows = prop.cpu_plan.run_rows

    def counted(x, pos, slots, table, seq_lens, tree_lo=None, tree_bits=None):
        calls["n"] += 1
        calls["trees"] += tree_lo is not None
        return run_rows(x, pos, slots, table, seq_lens, tree_lo, tree_bits)

    prop.cpu_plan.run_rows = counted
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = ["Write a short poem about the sea.", "def fibonacci(n):"]
    got = llm.generate(prompts, sp, use_tqdm=False)
    steps = llm.engine.spec_stats.num_steps_on
    assert steps > 5 and calls["n"] >= steps and calls["trees"] >= 1  # the first pass of a step, then the tree
    ref = LLM(device="cpu", dtype=dtype, max_model_len=512).generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]

    # A 5-token catch-up in the draft's (now free) pool, blocks 0-1: the plan's decode rows (row t sees keys
    # 0..t) against the layer's modules in the packed prefill form, on the same input.
    from roofline.attention.backend import paged_metadata

    t, bs = 5, worker.block_size
    x = torch.randn(t, worker.model_config.hidden_size, dtype=getattr(torch, dtype))
    pos = torch.arange(t, dtype=torch.int64)
    table = np.array([[0, 1]] * t, dtype=np.int32)
    slots = (table[np.arange(t), np.arange(t) // bs].astype(np.int64) * bs + np.arange(t) % bs)
    meta = paged_metadata(slots, np.array([0, t]), np.array([t]), table[:1], torch.device("cpu"))
    out, res = prop.layer(pos, x.clone(), None, prop.backend.build_metadata(meta))
    want = out + res
    got_x = x.clone()
    assert prop.cpu_plan.run_rows(got_x, pos, torch.from_numpy(slots), torch.from_numpy(table), pos + 1)
    if dtype == "bfloat16":
        assert torch.equal(got_x, want)
    else:  # fp32 keeps what bf16 rounds away: the prefill form's SDPA sums its keys in another order
        torch.testing.assert_close(got_x, want, rtol=2e-5, atol=1e-4)
