"""Prompt logprobs (``SamplingParams.prompt_logprobs``) on the real default model in fp32, on CPU.

The reference is transformers' forward over the whole prompt (the ``hf_oracle`` fixture), log-softmax in
float64. Our entries come from a chunked prefill (a 32-token budget splits the 84-token prompt into three
chunks, so the last position of each chunk scores the next chunk's first token), with async scheduling off
and on. Tolerance: 1e-4 abs on logprobs; measured max |diff| 2.5e-5 (the two fp32 forwards differ in op
order, as in test_parity.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from roofline import LLM, SamplingParams

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden press adapted from wine making. Within fifty years "
        "printers worked in more than two hundred European towns, and the price of books fell so far that "
        "students could own them. Scholars argue about how much this changed the Reformation, science and "
        "literacy, but few doubt that it changed how ideas travelled.")
BUDGET = 32  # max_num_batched_tokens of the chunked engine
K = 5
TOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
WITH_PROMPT_LPS = dataclasses.replace(GREEDY, prompt_logprobs=K)


@pytest.fixture(scope="module")
def chunked_llm():
    """A small step budget (chunked prefill) and a KV pool of 8 blocks of 16 (preemption under load)."""
    return LLM(device="cpu", dtype="float32", attention_backend="torch", max_model_len=128,
               max_num_batched_tokens=BUDGET, block_size=16, num_kv_blocks=8)


def set_async(llm: LLM, on: bool) -> None:
    """Switch async scheduling between runs (only the engine's step loop reads it; nothing is in flight)."""
    engine = llm.engine
    assert engine._inflight is None and not engine.has_unfinished_requests()
    engine.config = dataclasses.replace(engine.config, async_scheduling=on)


@pytest.fixture(scope="module")
def prompt_ids(chunked_llm):
    ids = chunked_llm.tokenizer(TEXT).input_ids
    assert len(ids) == 84 and len(ids) > 2 * BUDGET
    return ids


@pytest.fixture(scope="module")
def reference(hf_oracle, prompt_ids):
    """[P - 1, V] float64 log-softmax of transformers' logits: row p scores prompt token p + 1."""
    with torch.no_grad():
        logits = hf_oracle(torch.tensor([prompt_ids])).logits[0, :-1]
    return logits.double().log_softmax(-1)


@pytest.fixture(scope="module")
def greedy_alone(default_llm, prompt_ids):
    """The greedy tokens without prompt logprobs, whole prompt in one step."""
    out = default_llm.generate({"prompt_token_ids": prompt_ids}, GREEDY, use_tqdm=False)[0]
    assert out.prompt_logprobs is None
    return out.outputs[0].token_ids


def assert_matches_reference(plps, prompt_ids, reference, k=K):
    """One entry per prompt token, the first None; each holds the actual token with its rank and the top-k
    (ranks 1..k, logprobs descending), all within TOL of the float64 reference."""
    assert len(plps) == len(prompt_ids) and plps[0] is None
    for i in range(1, len(prompt_ids)):
        entry, ref, tok = plps[i], reference[i - 1], prompt_ids[i]
        assert tok in entry, i
        assert abs(entry[tok].logprob - ref[tok].item()) < TOL, i
        # The rank counts tokens strictly more likely; allow reordering only among tokens within TOL.
        lo = int((ref > ref[tok] + TOL).sum()) + 1
        hi = int((ref > ref[tok] - TOL).sum()) + 1
        assert lo <= entry[tok].rank <= hi, (i, entry[tok].rank, lo, hi)
        top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= k)
        assert [r for r, _, _ in top] == list(range(1, k + 1)), i
        values = [v for _, _, v in top]
        assert values == sorted(values, reverse=True), i
        ref_top = ref.topk(k)
        assert max(abs(a - b) for a, b in zip(values, ref_top.values.tolist(), strict=True)) < TOL, i
        for _, t, v in top:
            assert abs(v - ref[t].item()) < TOL, i
        assert len(entry) == k + (entry[tok].rank > k)
        assert all(lp.decoded_token is not None for lp in entry.values())


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_chunked_prompt_logprobs_match_transformers(chunked_llm, prompt_ids, reference, greedy_alone,
                                                    async_scheduling):
    set_async(chunked_llm, async_scheduling)
    out = chunked_llm.generate({"prompt_token_ids": prompt_ids}, WITH_PROMPT_LPS, use_tqdm=False)[0]
    assert_matches_reference(out.prompt_logprobs, prompt_ids, reference)
    assert out.outputs[0].token_ids == greedy_alone
    assert out.prompt_logprobs[1][prompt_ids[1]].decoded_token == chunked_llm.tokenizer.decode([prompt_ids[1]])
    # Zero alternatives: only the actual token of each position.
    zero = chunked_llm.generate({"prompt_token_ids": prompt_ids[:40]}, dataclasses.replace(GREEDY, prompt_logprobs=0),
                                use_tqdm=False)[0]
    assert len(zero.prompt_logprobs) == 40 and zero.prompt_logprobs[0] is None
    for i in range(1, 40):
        assert list(zero.prompt_logprobs[i]) == [prompt_ids[i]]
        assert abs(zero.prompt_logprobs[i][prompt_ids[i]].logprob - reference[i - 1, prompt_ids[i]].item()) < TOL


def test_mixed_batch_keeps_other_requests_unchanged(chunked_llm, prompt_ids, reference, greedy_alone):
    """One request with prompt logprobs beside others without: every request's tokens equal its run alone,
    and only the asking request gets (the same) prompt logprobs."""
    set_async(chunked_llm, True)
    others = ["The capital of France is", "def fibonacci(n):"]
    other_params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2),
                    SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)]
    alone = [chunked_llm.generate(p, sp, use_tqdm=False)[0] for p, sp in zip(others, other_params, strict=True)]
    outs = chunked_llm.generate([others[0], {"prompt_token_ids": prompt_ids}, others[1]],
                                [other_params[0], WITH_PROMPT_LPS, other_params[1]], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == greedy_alone
    assert_matches_reference(outs[1].prompt_logprobs, prompt_ids, reference)
    for got, want in zip([outs[0], outs[2]], alone, strict=True):
        assert got.prompt_logprobs is None
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert [set(e) for e in outs[0].outputs[0].logprobs] == [set(e) for e in alone[0].outputs[0].logprobs]


def test_preemption_and_n_samples_give_one_complete_list(chunked_llm, prompt_ids, hf_oracle):
    """Three 70-token prompts (four sequences, 70 + 4 tokens: 5 blocks each) in an 8-block pool: a sequence
    is preempted mid-prefill, after its first chunk was scored, and scores its prompt again (the repeats
    are dropped); n=2 scores the prompt twice. Each request still has one entry per prompt token, equal to
    its reference. The prompts are slices not seen before, so no earlier run's cached blocks relieve the pool."""
    set_async(chunked_llm, True)
    prompts = [prompt_ids[s:s + 70] for s in (1, 5, 9)]
    with torch.no_grad():
        refs = hf_oracle(torch.tensor(prompts)).logits[:, :-1].double().log_softmax(-1)
    params = [WITH_PROMPT_LPS, dataclasses.replace(WITH_PROMPT_LPS, n=2, prompt_logprobs=2), WITH_PROMPT_LPS]
    outs = chunked_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert chunked_llm.last_run_stats.num_preemptions > 0
    for out, prompt, ref, p in zip(outs, prompts, refs, params, strict=True):
        assert_matches_reference(out.prompt_logprobs, prompt, ref, k=p.prompt_logprobs)
    assert outs[1].outputs[0].token_ids == outs[1].outputs[1].token_ids  # greedy, one prompt
    assert not chunked_llm.engine.has_unfinished_requests() and chunked_llm.engine._inflight is None
