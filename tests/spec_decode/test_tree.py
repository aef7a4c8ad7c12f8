"""Token trees (``roofline.spec_decode.tree``): drafting (EAGLE-2 dynamic tree, Medusa Cartesian candidates),
the ancestor mask in a real verify pass against each root-to-leaf path run alone, the KV compaction of the
accepted path, exact acceptance (greedy path; recursive rejection over children, chi-square), greedy token
identity through the engine (tiny model here, the default model in the slow tests) and bad configs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.attention.backend import paged_metadata, slot_mapping
from roofline.spec_config import SpeculativeConfig, max_tree_nodes
from roofline.spec_decode import features, train
from roofline.spec_decode.heads import save_head
from roofline.spec_decode.tree import (
    DraftTree,
    best_first_tree,
    compact_kv,
    region_mask,
    residual_sample,
    select_nodes,
    walk,
)

from .tiny import CHATS, COMMON, DEFAULT, VOCAB

# A 7-node tree: root -> {0, 1}; 0 -> {2, 3}; 1 -> {4}; 2 -> {5}; 4 -> {6}
TREE7 = DraftTree(np.array([5, 7, 9, 11, 13, 15, 17]), np.array([-1, -1, 0, 0, 1, 2, 4]),
                  np.array([1, 1, 2, 2, 2, 3, 3]))



@pytest.fixture(scope="module")
def heads(tiny, tmp_path_factory):
    """{method: dir}: heads trained a few steps on the tiny model's own answers (as test_learned_heads)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, VOCAB, size=int(rng.integers(6, 14))).tolist() for _ in range(12)]
    seqs = train.regenerate(tiny, prompts, max_tokens=20)
    feats = [features.target_features(tiny, ids) for ids, _ in seqs]
    out = {}
    for method in ("eagle", "medusa"):
        cfg, tensors, _, _ = train.train_head(tiny, method, seqs, feats, steps=24, batch_size=4, lr=5e-3,
                                              num_heads=3, progress=False)
        d = tmp_path_factory.mktemp(method)
        save_head(str(d), cfg, tensors)
        out[method] = str(d)
    return out


# ------------------------------------------------------------------------------ structure


def test_region_mask_bits():
    # width 8 >= 1 + 7: the root is region row 0 (plain, -1) and bit 0 of every node's mask
    m = region_mask(TREE7, 8)
    assert m.tolist() == [-1, 0b11, 0b101, 0b1011, 0b10011, 0b100101, 0b1001011, 0b10100101]
    # width 7 == N: the root is before the region (seen as prefix), node bits start at 0
    assert region_mask(TREE7, 7).tolist() == [0b1, 0b10, 0b101, 0b1001, 0b10010, 0b100101, 0b1010010]
    # a 64-node chain sets bit 63 (a negative int64)
    chain = region_mask(DraftTree.chain(list(range(64))), 64)
    assert chain[-1] == -1 and chain[0] == 1 and chain[62] == (1 << 63) - 1
    with pytest.raises(ValueError, match=r"a tree of 7 nodes needs a mask width in \[7, 64\], got 6"):
        region_mask(TREE7, 6)


def test_select_nodes_keeps_parents_and_orders_breadth_first():
    # candidates: depth 1: a(-0.1) b(-1.0); depth 2 under a: c(-0.3) d(-2.0); under b: e(-1.2)
    tree, src = select_nodes([-1, -1, 0, 0, 1], [10, 11, 12, 13, 14], [-0.1, -1.0, -0.3, -2.0, -1.2],
                             [1, 1, 2, 2, 2], 4)
    assert tree.tokens.tolist() == [10, 11, 12, 14] and tree.parents.tolist() == [-1, -1, 0, 1]
    assert tree.depth.tolist() == [1, 1, 2, 2] and src == [0, 1, 2, 4]
    assert [tree.path(i) for i in tree.leaves()] == [[0, 2], [1, 3]]


def test_best_first_tree_is_the_best_paths_of_the_cartesian_product():
    rng = np.random.default_rng(0)
    toks = np.arange(12).reshape(3, 4)
    lps = np.sort(np.log(rng.dirichlet(np.ones(8), size=3))[:, :4], axis=1)[:, ::-1]
    tree = best_first_tree(toks, lps, 10)
    # every prefix of the product, scored; the tree holds exactly the 10 best
    import itertools

    scores = {}
    for d in range(1, 4):
        for choice in itertools.product(range(4), repeat=d):
            scores[tuple(toks[i, c] for i, c in enumerate(choice))] = sum(lps[i, c] for i, c in enumerate(choice))
    best = sorted(scores.values(), reverse=True)[:10]
    got = sorted((sum(lps[tree.depth[n] - 1, toks[tree.depth[n] - 1].tolist().index(tree.tokens[n])]
                      for n in tree.path(i))) for i in range(len(tree)))
    np.testing.assert_allclose(sorted(best), got)
    assert all(tree.parents[i] < i for i in range(len(tree)))
    assert max_tree_nodes("medusa", 4, 3) == 64 and max_tree_nodes("eagle", 2, 3) == 10


# ------------------------------------------------------------------------------ acceptance


def test_greedy_walk_takes_the_longest_matching_path():
    argmax = np.array([7, 0, 15, 0, 0, 0, 0, 0])  # root -> 7 (node 1) -> 13? no: node 1's argmax is 15
    w = walk(TREE7, np.zeros(7), argmax, True, None, None)
    assert (w.path, w.token, w.stop_node) == ([1], 15, 1)  # node 1 (7); its only child (13) != 15
    argmax = np.array([5, 9, 0, 0, 0, 0, 0, 0])
    argmax[1 + 2] = 15  # node 2 (9)'s argmax is its child 15 (node 5)
    argmax[1 + 5] = 3
    w = walk(TREE7, np.zeros(7), argmax, True, None, None)
    assert (w.path, w.token) == ([0, 2, 5], 3)


def _chisq_pvalue(obs: np.ndarray, exp: np.ndarray) -> float:
    keep = exp >= 5
    o, e = obs[keep], exp[keep]
    if exp[~keep].sum() > 0:
        o, e = np.append(o, obs[~keep].sum()), np.append(e, exp[~keep].sum())
    e = e * o.sum() / e.sum()
    stat = float(((o - e) ** 2 / e).sum())
    return float(torch.special.gammaincc(torch.tensor((len(o) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_tree_sampling_keeps_the_targets_distribution():
    """Recursive rejection over children: the first emitted token follows the target at the root, and the
    second, given that the first was node 0's token (5), follows the target at node 0. 40,000 walks over
    TREE7 with random target distributions over 20 tokens; chi-square, cells with expected count < 5 pooled,
    p-value threshold 1e-3 for each."""
    rng = np.random.default_rng(7)
    v = 20
    p = rng.dirichlet(np.full(v, 0.5), size=8)  # p[0] root, p[1 + i] node i
    p[0, [5, 7]] += [0.3, 0.2]  # the root's children carry real mass
    p[1, [9, 11]] += [0.2, 0.2]
    p /= p.sum(1, keepdims=True)
    child_p = np.array([p[par + 1, tok] for par, tok in zip(TREE7.parents, TREE7.tokens, strict=True)])

    probs = torch.from_numpy(p)
    gen = torch.Generator().manual_seed(7)

    def final(node, rejected):  # the verifier's last draw
        return residual_sample(probs[node + 1], rejected, gen)

    n = 40_000
    first, second = np.zeros(v), np.zeros(v)
    for _ in range(n):
        w = walk(TREE7, child_p, p.argmax(1), False, rng.random, final)
        toks = [int(TREE7.tokens[c]) for c in w.path] + [w.token]
        first[toks[0]] += 1
        if toks[0] == 5:
            second[toks[1]] += 1
    assert _chisq_pvalue(first, p[0] * n) > 1e-3
    assert second.sum() > 5_000 and _chisq_pvalue(second, p[1] * second.sum()) > 1e-3


# ------------------------------------------------------------------------------ one target pass


def test_tree_verify_pass_equals_each_path_alone_and_compacts_kv(tiny_dir):
    """A prefix, the root and TREE7's nodes in one forward with the ancestor mask (the worker's layout: node i
    in the slot of position n + i, RoPE position n - 1 + depth): every node's log-probabilities equal the
    prefix + path run alone (``score_logprobs``); after ``compact_kv`` moves path [1, 4, 6] to positions n ..
    n + 2, every layer's K/V there equals the plain run's."""
    llm = LLM(str(tiny_dir), **COMMON)
    w = llm.engine.worker
    bs = w.block_size
    prefix = [3, 8, 21, 4, 30, 12, 6, 19, 25, 2]  # t_0 .. t_{n-1}; the root is t_{n-1}
    n = len(prefix)
    table = np.array([[0, 1, 2]], dtype=np.int32)  # scratch blocks (nothing else is running)
    ids = np.array(prefix + TREE7.tokens.tolist())
    slot_pos = np.arange(len(ids))
    pos = slot_pos.copy()
    pos[n:] = n - 1 + TREE7.depth
    mask = region_mask(TREE7, len(TREE7))[None]
    meta = paged_metadata(slot_mapping(table, np.zeros(len(ids), dtype=np.int64), slot_pos, bs),
                          np.array([0, len(ids)]), np.array([len(ids)]), table, w.device, mask)
    with torch.inference_mode():
        hidden = w.model(torch.from_numpy(ids), torch.from_numpy(pos), w.backend.build_metadata(meta))
        got = torch.log_softmax(w.model.compute_logits(hidden), -1)
    path = [1, 4, 6]
    src = slot_mapping(table, np.zeros(3, dtype=np.int64), np.array([n + c for c in path]), bs)
    dst = slot_mapping(table, np.zeros(3, dtype=np.int64), np.arange(n, n + 3), bs)
    compact_kv(w.backend.kv_pool, torch.from_numpy(src), torch.from_numpy(dst))
    kept = [torch.stack([c.k.view(-1, *c.k.shape[2:])[:n + 3], c.v.view(-1, *c.v.shape[2:])[:n + 3]]).clone()
            for c in w.backend.kv_pool.caches]
    plain = prefix + [int(TREE7.tokens[c]) for c in path]
    meta = paged_metadata(slot_mapping(table, np.zeros(len(plain), dtype=np.int64), np.arange(len(plain)), bs),
                          np.array([0, len(plain)]), np.array([len(plain)]), table, w.device)
    with torch.inference_mode():
        w.model(torch.tensor(plain), torch.arange(len(plain)), w.backend.build_metadata(meta))
    for c, k in zip(w.backend.kv_pool.caches, kept, strict=True):
        torch.testing.assert_close(k[0], c.k.view(-1, *c.k.shape[2:])[:n + 3], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(k[1], c.v.view(-1, *c.v.shape[2:])[:n + 3], atol=2e-5, rtol=2e-5)

    # score_logprobs takes scratch blocks from the allocator (possibly 0..2): after the KV checks
    for leaf in TREE7.leaves():
        path = TREE7.path(leaf)
        alone = llm.score_logprobs(prefix + [int(TREE7.tokens[c]) for c in path])
        torch.testing.assert_close(got[n - 1], alone[n - 1], atol=2e-5, rtol=2e-5)  # the root row
        for j, c in enumerate(path, start=1):
            torch.testing.assert_close(got[n + c], alone[n - 1 + j], atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------------------ through the engine


@pytest.mark.parametrize(("method", "topk", "budget"), [("eagle", 2, 6), ("medusa", 3, 8)])
def test_tree_greedy_is_token_identical_on_the_tiny_model(tiny, tiny_dir, heads, method, topk, budget):
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(2, VOCAB, size=int(n)).tolist()} for n in (5, 17, 33)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in tiny.generate(prompts, sp, use_tqdm=False)]
    llm = LLM(str(tiny_dir), speculative_config={"method": method, "model": heads[method], "adaptive": False,
                                                 "num_speculative_tokens": 3, "tree_topk": topk,
                                                 "tree_budget": budget}, **COMMON)
    seen = []
    verify = llm.engine.worker.inputs

    class Spy(dict):  # records each step's trees as the proposer sets them
        def __setitem__(self, k, v):
            seen.append(len(v))
            super().__setitem__(k, v)

    verify.trees = Spy()
    import roofline.spec_decode.verifier as verifier

    orig = verifier.verify_tree

    def spy(worker, *a):
        out = orig(worker, *a)
        worker.inputs.trees = Spy()
        return out

    verifier.verify_tree = spy
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    finally:
        verifier.verify_tree = orig
    assert got == ref
    assert seen and max(seen) == budget  # full trees were drafted and verified
    assert llm.engine.spec_stats.num_drafts > 0


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_tree_greedy_is_token_identical_with_a_quantized_cache(tiny_dir, heads, kv):
    """With an int8 / fp8 KV cache on the CPU every query row, a tree node's too (by its ancestor mask), is one
    item of the C++ kernel over its own keys: an EAGLE tree's greedy tokens equal plain decoding's with the same
    cache, the accepted nodes' codes (and int8's per-slot scales) compacted into place."""
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": rng.integers(2, VOCAB, size=int(n)).tolist()} for n in (6, 21, 40)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(tiny_dir), kv_cache_dtype=kv, **COMMON)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    llm = LLM(str(tiny_dir), kv_cache_dtype=kv, speculative_config={
        "method": "eagle", "model": heads["eagle"], "adaptive": False, "num_speculative_tokens": 3, "tree_topk": 2,
        "tree_budget": 6}, **COMMON)
    assert llm.engine.worker.kv_pool.caches[0].is_quantized
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == ref
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0


def test_tree_steps_as_decode_rows_see_what_the_prefill_form_sees(tiny_dir, heads):
    """``InputPreparer`` with ``tree_as_decode_rows`` (the Triton backend's default, whose CUDA graphs replay it)
    lays a tree verify step out as one decode row per query row with ``tree_lo`` / ``tree_bits``. On every tree
    step of a real engine run, each row sees exactly the keys that the prefill form's ancestor mask
    (``tree_decode_rows``, the form checked against per-path runs above) shows it, through the same block table;
    the inputs, positions and slots are the same. (The engine itself runs the prefill form: the torch backend.)"""
    from roofline.attention.backend import tree_decode_rows

    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": rng.integers(2, VOCAB, size=int(n)).tolist()} for n in (9, 21)]
    llm = LLM(str(tiny_dir), speculative_config={"method": "eagle", "model": heads["eagle"], "adaptive": False,
                                                 "num_speculative_tokens": 3, "tree_topk": 2, "tree_budget": 5},
              **COMMON)
    inputs = llm.engine.worker.inputs
    orig, checked = inputs.prepare_inputs, []

    def both(step, tag=""):
        out = orig(step, tag)
        if inputs.trees:
            inputs.tree_as_decode_rows = True
            try:
                rows = orig(step, tag)
            finally:
                inputs.tree_as_decode_rows = False
            for a, b in zip(out[:2], rows[:2], strict=True):
                assert torch.equal(a, b)  # input ids, positions
            pm, dm = out[2], rows[2]
            assert dm.tree_mask is None and dm.is_decode_only and pm.tree_mask is not None
            assert torch.equal(pm.slot_mapping, dm.slot_mapping)
            table, lens, lo, bits = tree_decode_rows(pm, len(out[1]))
            assert dm.seq_lens.tolist() == lens.tolist() and torch.equal(dm.block_tables, table)
            for i, n in enumerate(lens.tolist()):
                p = np.arange(n)

                def seen(lo_i, bits_i, p=p):
                    rel = p - lo_i
                    return (rel < 0) | ((bits_i >> np.clip(rel, 0, 63)) & 1 == 1)

                assert (seen(int(lo[i]), int(bits[i])) == seen(int(dm.tree_lo[i]), int(dm.tree_bits[i]))).all()
            checked.append(len(lens))
        return out

    inputs.prepare_inputs = both
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert checked and max(checked) == 2 * (1 + 5)  # both requests verified full trees in one step


def test_trees_respect_max_tokens_and_max_model_len(tiny, tiny_dir, heads):
    """Near a request's max_tokens a tree is no deeper than the tokens left (the controller sends fewer nodes
    than the depth), and near max_model_len (128) no wider than the slots left: outputs equal plain decoding's
    and stop exactly at the limit."""
    llm = LLM(str(tiny_dir), speculative_config={"method": "eagle", "model": heads["eagle"], "adaptive": False,
                                                 "num_speculative_tokens": 3, "tree_topk": 2}, **COMMON)
    prompts = [{"prompt_token_ids": [3 + i, 9, 27, 5, 11][:4 + i % 2]} for i in range(4)]
    for m in (1, 2, 3, 5):
        sp = SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
        ref = [o.outputs[0].token_ids for o in tiny.generate(prompts, sp, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert got == ref and all(len(t) == m for t in got)
    long = {"prompt_token_ids": [(7 * i) % (VOCAB - 2) + 2 for i in range(118)]}  # 10 slots to max_model_len
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    ref = tiny.generate(long, sp, use_tqdm=False)[0].outputs[0].token_ids
    got = llm.generate(long, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert got == ref and len(got) == 10


def test_tree_logprobs_are_the_targets(tiny, tiny_dir, heads):
    """Greedy with logprobs=2: a tree's emitted tokens carry the target's logprobs at their positions (the root's
    and the accepted path's rows of the verify pass), as plain decoding reports them."""
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompt = {"prompt_token_ids": [4, 8, 15, 16, 23, 42, 7, 3]}
    ref = tiny.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    llm = LLM(str(tiny_dir), speculative_config={"method": "medusa", "model": heads["medusa"], "adaptive": False,
                                                 "num_speculative_tokens": 3, "tree_topk": 3}, **COMMON)
    got = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == ref.token_ids and llm.engine.spec_stats.num_drafts > 0
    for t, a, b in zip(got.token_ids, got.logprobs, ref.logprobs, strict=True):
        assert set(a) == set(b) and t in a
        for tok in a:
            assert a[tok].logprob == pytest.approx(b[tok].logprob, abs=1e-4)
            assert a[tok].rank == b[tok].rank


def test_tree_sampling_through_the_engine_is_seeded_and_valid(tiny_dir, heads):
    """Seeded sampling with an EAGLE tree repeats itself and emits the requested number of tokens."""
    llm = LLM(str(tiny_dir), speculative_config={"method": "eagle", "model": heads["eagle"], "adaptive": False,
                                                 "num_speculative_tokens": 3, "tree_topk": 2}, **COMMON)
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3, n=3)
    a = [c.token_ids for c in llm.generate({"prompt_token_ids": [5, 9, 17, 3]}, sp, use_tqdm=False)[0].outputs]
    b = [c.token_ids for c in llm.generate({"prompt_token_ids": [5, 9, 17, 3]}, sp, use_tqdm=False)[0].outputs]
    assert a == b and all(len(t) == 12 and all(0 <= x < VOCAB for x in t) for t in a)


def test_eagle_tree_sampling_keeps_the_targets_distribution_through_the_engine(tiny, tiny_dir, heads):
    """As the chain's test (test_learned_heads): chi-square goodness of fit of the second sampled token (the
    first one verified against an EAGLE tree: depth 3, top-2, 6 nodes) to the target's exact marginal
    sum_t1 p(t1) p(t2 | t1), from 1200 seeded samples at temperature 1; cells with expected count < 5 pooled,
    p-value threshold 1e-3."""
    prompt = [5, 9, 17, 3, 22, 40, 11]
    lp1 = tiny.score_logprobs(prompt)[-1].exp().double()
    p2 = torch.zeros(VOCAB, dtype=torch.float64)
    for t1 in range(VOCAB):
        p2 += lp1[t1] * tiny.score_logprobs(prompt + [t1])[-1].exp().double()
    big = {**COMMON, "max_num_seqs": 1024, "max_num_batched_tokens": 8192}
    llm = LLM(str(tiny_dir), speculative_config={"method": "eagle", "model": heads["eagle"], "adaptive": False,
                                                 "num_speculative_tokens": 3, "tree_topk": 2, "tree_budget": 6},
              **big)
    n = 1200
    sps = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=1234 + 10_000 * i, n=n // 2)
           for i in range(2)]
    outs = [llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0] for sp in sps]
    counts = np.bincount([c.token_ids[1] for o in outs for c in o.outputs], minlength=VOCAB).astype(float)
    assert llm.engine.spec_stats.num_drafts >= n
    assert _chisq_pvalue(counts, p2.numpy() * n) > 1e-3


def test_bad_tree_configs_are_refused():
    ok = SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 4, "tree_topk": 3})
    assert ok.tree_budget == max_tree_nodes("eagle", 3, 4) == 30
    cases = [
        ({"method": "eagle", "num_speculative_tokens": 4, "tree_topk": 0}, r"tree_topk must be an integer in \[1, 16\], got 0"),
        ({"method": "medusa", "num_speculative_tokens": 2, "tree_topk": 17}, r"tree_topk must be an integer in \[1, 16\], got 17"),
        ({"method": "eagle", "num_speculative_tokens": 6, "tree_topk": 4, "tree_budget": 65},
         r"tree_budget must be an integer in \[6, 64\] .*got 65"),
        ({"method": "medusa", "num_speculative_tokens": 2, "tree_topk": 2, "tree_budget": 7},
         r"tree_budget must be an integer in \[2, 6\] .*tree_topk 2 and depth 2.*got 7"),
        ({"method": "eagle", "num_speculative_tokens": 8, "tree_topk": 4, "tree_budget": 3},  # depth 8 in 3 nodes
         r"tree_budget must be an integer in \[8, 64\] \(at least a node per depth.*got 3"),
        ({"method": "eagle", "num_speculative_tokens": 2, "tree_budget": 4}, "tree_budget needs tree_topk"),
        # A bad value is named before the missing tree_topk.
        ({"method": "eagle", "num_speculative_tokens": 4, "tree_budget": -1},
         r"tree_budget must be an integer in \[1, 64\] \(the tree's nodes, with tree_topk\), got -1"),
        ({"method": "eagle", "num_speculative_tokens": 4, "tree_budget": 1.5}, r"tree_budget must be an integer.*got 1.5"),
        ({"method": "eagle", "num_speculative_tokens": 4, "tree_budget": 100000}, r"\[1, 64\].*got 100000"),
        ({"method": "ngram", "num_speculative_tokens": 2, "tree_topk": 2},
         "tree_topk applies to methods eagle and medusa .*not 'ngram'"),
        ({"method": "eagle", "num_speculative_tokens": 2, "tree_topk": True}, "tree_topk must be an integer"),
    ]
    for d, msg in cases:
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.from_dict(d)


def test_a_backend_without_tree_masks_refuses_one(tiny):
    from roofline.attention.backend import AttentionBackend

    w = tiny.engine.worker
    meta = paged_metadata(np.array([0]), np.array([0, 1]), np.array([1]), np.zeros((1, 1), dtype=np.int32),
                          w.device, np.array([[-1]]))

    class NoTree(type(w.backend)):
        name = "no-tree"
        supports_tree_mask = False

    b = NoTree.__new__(NoTree)
    with pytest.raises(ValueError, match="the no-tree attention backend cannot apply a speculative tree"):
        AttentionBackend.build_metadata(b, meta)


# ------------------------------------------------------------------------------ the default model



@pytest.mark.slow
@pytest.mark.parametrize("spec", [{"method": "eagle", "num_speculative_tokens": 4, "tree_topk": 3, "tree_budget": 12},
                                  {"method": "medusa", "num_speculative_tokens": 3, "tree_topk": 3,
                                   "tree_budget": 12}])
def test_shipped_heads_as_trees_are_token_identical_on_the_default_model(default_greedy_ref, spec):
    llm = LLM(speculative_config={**spec, "adaptive": False}, **DEFAULT)
    got = [o.outputs[0].token_ids for o in llm.chat(CHATS, SamplingParams(temperature=0.0, max_tokens=48),
                                                    use_tqdm=False)]
    assert got == default_greedy_ref
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_seeded_sampling_repeats_under_the_adaptive_policy_whatever_runs_beside_it(tiny_dir, heads, method):
    """A seeded random request's draws are keyed by (seed, position) (``sampler.keyed_seed``) in plain steps and
    verify passes alike, so the adaptive policy may draft or not on any step (another request's prefill chunks
    in the step, speculation judged off): the same seed gives the same tokens alone, again, and beside a long
    prompt whose chunked prefill shares its steps. A fresh user found EAGLE / Medusa with the default adaptive
    policy drawing other tokens for 3 of 4 seeds (`` the earth: Now I am in victory`` against `` the earth comes
    fortune. But I will``)."""
    llm = LLM(str(tiny_dir), speculative_config={"method": method, "model": heads[method],
                                                 "num_speculative_tokens": 2},
              **{**COMMON, "max_num_batched_tokens": 16})
    assert llm.engine.spec.policy.adaptive
    long_prompt = {"prompt_token_ids": [(7 * i) % VOCAB for i in range(1, 90)]}
    for seed in (1, 2, 3):
        sp = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=seed)
        runs = [llm.generate({"prompt_token_ids": [5, 9, 17, 3]}, sp, use_tqdm=False)[0].outputs[0].token_ids
                for _ in range(2)]
        beside = llm.generate([{"prompt_token_ids": [5, 9, 17, 3]}, long_prompt],
                              [sp, SamplingParams(temperature=1.0, max_tokens=4)], use_tqdm=False)
        runs.append(beside[0].outputs[0].token_ids)
        assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 16, (seed, runs)


@pytest.mark.parametrize("spec", [
    {"method": "eagle", "num_speculative_tokens": 2, "adaptive": False},  # chain: rejection_sample's matched rows
    {"method": "eagle", "num_speculative_tokens": 3, "tree_topk": 2, "tree_budget": 6, "adaptive": False},  # tree walk
    {"method": "medusa", "num_speculative_tokens": 2, "tree_topk": 3, "tree_budget": 6, "adaptive": False},
    {"method": "eagle", "num_speculative_tokens": 2, "tree_topk": 3},  # the adaptive policy: drafting or not
    {"method": "draft_model", "num_layers": 1, "num_speculative_tokens": 3, "adaptive": False},  # sampled drafts
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False},
])
def test_seeded_sampling_equals_the_plain_engine_token_for_token(tiny, tiny_dir, heads, spec):
    """A seeded random row is verified by matching each draft against the target's own keyed sample at its
    position (``verifier.keyed_samples``), so its tokens are the plain engine's for the same seed, with
    speculation on or off, at any temperature and top-p; and drafts are still accepted."""
    spec = {**spec, "model": heads[spec["method"]]} if spec["method"] in heads else spec
    llm = LLM(str(tiny_dir), speculative_config=spec, **COMMON)
    prompts = [{"prompt_token_ids": [5, 9, 17, 3, 5, 9, 17]}, {"prompt_token_ids": [(7 * i) % VOCAB for i in range(1, 30)]}]
    sps = [SamplingParams(temperature=t, top_p=tp, max_tokens=24, ignore_eos=True, seed=seed)
           for seed, t, tp in ((1, 1.0, 1.0), (2, 0.7, 0.9))]
    got = [[o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] for sp in sps]
    ref = [[o.outputs[0].token_ids for o in tiny.generate(prompts, sp, use_tqdm=False)] for sp in sps]
    assert got == ref
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0, spec
    if spec.get("adaptive") is False:  # the adaptive policy may keep speculation off after its probes, as it did
        assert stats.num_accepted_tokens > 0, spec
