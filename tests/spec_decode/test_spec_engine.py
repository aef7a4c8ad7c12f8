"""Speculative decoding in the batched engine, on the default model (CPU, fp32): greedy output token-identical
to non-speculative decoding for both proposers, stops and limits inside an accepted run, logprobs, n > 1 with
seeds, preemption, the acceptance accounting, and start-up errors."""

from __future__ import annotations

import pytest

from roofline import LLM, SamplingParams

PROMPTS = [
    "Rewrite this function with type hints and a docstring:\n\ndef area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n",
    "Repeat the following sentence three times: the cat sat on the mat and looked at the dog.",
    "Summarize: The city council met on Tuesday to discuss the new park. The council voted to build the park "
    "next year. The park will have a playground, a pond and a garden.",
    "What is 2 + 2?",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4,
         "adaptive": False}
COMMON = dict(max_model_len=1024, dtype="float32", device="cpu", attention_backend="torch",
              max_num_batched_tokens=2048)


def _ids(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def greedy_ref(default_llm):
    sp = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    return _ids(default_llm.generate(PROMPTS, sp, use_tqdm=False))


@pytest.fixture(scope="module")
def ngram_llm():
    return LLM(speculative_config=NGRAM, **COMMON)


def test_ngram_greedy_is_token_identical(ngram_llm, greedy_ref):
    sp = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    before = ngram_llm.engine.spec_stats.copy()
    decode_before = ngram_llm.engine.stats.num_decode_steps
    assert _ids(ngram_llm.generate(PROMPTS, sp, use_tqdm=False)) == greedy_ref
    st = ngram_llm.engine.spec_stats.since(before)
    # A verify step (each sequence's next token and its drafts, no prefill) is a decode step of the run summary.
    assert ngram_llm.engine.stats.num_decode_steps - decode_before >= st.num_steps_on > 0, st.as_dict()
    assert st.num_drafts > 20 and st.num_accepted_tokens > 20, st.as_dict()
    # Accounting: every verify pass emits its accepted drafts plus one token.
    assert st.num_emitted_tokens == st.num_accepted_tokens + st.num_drafts
    assert 0.0 <= st.acceptance_rate <= 1.0
    assert sum(st.accepted_per_position) == st.num_accepted_tokens
    # Output tokens = those emitted by verify passes + one per plain decode or prefill-ending step.
    assert st.num_emitted_tokens <= 4 * 128
    # The n-gram lookup runs in the scheduler, before the step: no proposer time inside the worker's step.
    assert st.draft_seconds == 0 and st.verify_ms_per_step > 0, st.as_dict()


def test_draft_model_greedy_is_token_identical(greedy_ref):
    """The layer-truncated self (first 20 of 30 layers) drafts 2 tokens per step."""
    llm = LLM(speculative_config={"method": "draft_model", "num_layers": 20, "num_speculative_tokens": 2,
                                  "adaptive": False}, **COMMON)
    sp = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    assert _ids(llm.generate(PROMPTS[:2], sp, use_tqdm=False)) == greedy_ref[:2]
    st = llm.engine.spec_stats
    assert st.num_drafts > 0 and st.num_emitted_tokens == st.num_accepted_tokens + st.num_drafts
    # The step-time split: two passes of 20 layers over one row against a 30-layer verify of three rows.
    # On the CPU a pass costs about its layers' share of a plain step and the verify about 1-1.3 plain steps,
    # so draft / verify is near 1; [0.3, 3] allows for the host work on either side.
    assert st.draft_ms_per_step > 0 and st.verify_ms_per_step > 0
    assert 0.3 < st.draft_ms_per_step / st.verify_ms_per_step < 3, st.as_dict()


def test_stops_and_limits_inside_an_accepted_run(default_llm, ngram_llm, greedy_ref):
    """max_tokens, a stop string and a stop token id that fall inside accepted drafts truncate there."""
    tok = default_llm.tokenizer
    text = tok.decode(greedy_ref[1])
    stop = text[len(text) // 2:len(text) // 2 + 6]
    for sp in (SamplingParams(temperature=0.0, max_tokens=37),
               SamplingParams(temperature=0.0, max_tokens=128, stop=[stop]),
               SamplingParams(temperature=0.0, max_tokens=128, stop_token_ids=[greedy_ref[1][50]])):
        ref = default_llm.generate(PROMPTS[1:2], sp, use_tqdm=False)[0].outputs[0]
        got = ngram_llm.generate(PROMPTS[1:2], sp, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)


def test_logprobs_are_the_targets(default_llm, ngram_llm):
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    ref = default_llm.generate(PROMPTS[1:2], sp, use_tqdm=False)[0].outputs[0]
    got = ngram_llm.generate(PROMPTS[1:2], sp, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == ref.token_ids and len(got.logprobs) == 40
    for a, b in zip(got.logprobs, ref.logprobs, strict=True):
        assert set(a) == set(b)
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) and a[t].rank == b[t].rank


def test_seeded_sampling_is_reproducible_with_n_2(ngram_llm):
    sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, ignore_eos=True, n=2, seed=11)
    a = ngram_llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    b = ngram_llm.generate(PROMPTS[:2] + PROMPTS[2:3], sp, use_tqdm=False)  # other requests in the batch
    for x, y in zip(a, b[:2], strict=True):
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        assert all(len(c.token_ids) == 24 for c in x.outputs)


def test_preemption_with_speculation(greedy_ref):
    """A pool of 16 blocks of 16 cannot hold four 96-token continuations at once: sequences are preempted
    and recomputed, and greedy output still matches."""
    llm = LLM(speculative_config=NGRAM, num_kv_blocks=16, **{**COMMON, "max_model_len": 256})
    sp = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    assert _ids(llm.generate(PROMPTS, sp, use_tqdm=False)) == [r[:96] for r in greedy_ref]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_pool.num_free_blocks == 16


def test_penalties_decode_without_drafts(default_llm, ngram_llm):
    sp = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3)
    before = ngram_llm.engine.spec_stats.copy()
    got = ngram_llm.generate(PROMPTS[1:2], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert got == default_llm.generate(PROMPTS[1:2], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert ngram_llm.engine.spec_stats.since(before).num_drafts == 0


def test_startup_errors():
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 29\] \(the target has 30 layers\), got 30"):
        LLM(speculative_config={"method": "draft_model", "num_layers": 30, "num_speculative_tokens": 2}, **COMMON)


def test_async_scheduling_between_drafting_steps(greedy_ref):
    """With async scheduling, steps that draft run synchronously and the rest overlap: greedy output is still
    the plain output, verify passes happen (fixed and adaptive gamma), and with the adaptive policy some steps
    ran without proposing (after a step that found no n-gram match, or while off)."""
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)  # > 3 probe intervals of 16 steps
    for adaptive in (False, True):
        llm = LLM(speculative_config={**NGRAM, "adaptive": adaptive}, async_scheduling=True, **COMMON)
        assert llm.engine.config.async_scheduling
        engine, skipped = llm.engine, []
        skip = engine._skip_drafting
        engine._skip_drafting = lambda _s=skipped, _f=skip: (_s.append(1), _f())[1]  # type: ignore[method-assign]
        assert _ids(llm.generate(PROMPTS, sp, use_tqdm=False)) == [r[:64] for r in greedy_ref]
        st = engine.spec_stats
        # Fixed gamma drafts at every decode step. The adaptive policy's on/off choice follows this machine's
        # step timings, so only its probes (every PROBE_INTERVAL steps off) are certain to draft.
        assert st.num_drafts > (0 if adaptive else 10), st
        assert st.num_emitted_tokens == st.num_accepted_tokens + st.num_drafts
        assert (len(skipped) > 0) == adaptive, len(skipped)


def test_freed_and_reallocated_blocks_reach_the_worker():
    """A tight pool (10 MiB: 14 blocks of 16), 4 requests at once: verify steps free surplus blocks that other
    sequences (or this one, under another id) take at once. The worker's block tables must follow the cuts, or
    a sequence writes KV into a block another one owns (greedy output then differs with no preemption)."""
    t = "The quick brown fox jumps over the lazy dog near the old stone bridge."
    p = f"Text: {t} Copy the text exactly. Text: {t} Copy the text exactly. Text:"
    prompts = [p, "The history of Rome", p + " A", "Once upon a time"]
    kw = {**COMMON, "max_model_len": 160, "kv_cache_memory": "10MiB"}
    sp = SamplingParams(temperature=0.0, max_tokens=48)
    ref = _ids(LLM(**kw).generate(prompts, sp, use_tqdm=False))
    for cfg in ({"method": "draft_model", "num_layers": 12, "num_speculative_tokens": 2, "adaptive": False},
                {**NGRAM, "num_speculative_tokens": 8}):
        llm = LLM(speculative_config=cfg, **kw)
        assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == ref, cfg
        assert llm.engine.spec_stats.num_drafts > 0


def test_async_timing_and_undrafted_steps_stay_in_flight(greedy_ref):
    """With async scheduling: (1) a plain step's period is timed for the policy only when the step launched
    beside it is decode-only too (a launched prefill chunk runs eager, and its launch would be charged to the
    decode step); (2) a drafting step whose policy chose gamma 0 is not run synchronously but left in flight.
    Greedy output stays the plain output."""
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(speculative_config={**NGRAM, "adaptive": True}, async_scheduling=True, **COMMON)
    eng = llm.engine
    launched: list[bool] = []  # is_decode_only of each launched step
    records: list[tuple[int, bool]] = []  # (gamma, whether the last launched step was decode-only)
    modes: list[str] = []
    launch, record_step, process = eng._launch, eng.spec_policy.record_step, eng._process
    eng._launch = lambda out: (launched.append(out.is_decode_only), launch(out))[1]  # type: ignore[method-assign]
    eng.spec_policy.record_step = lambda b, g, s: (records.append((g, launched[-1])), record_step(b, g, s))[1]
    eng._process = lambda *a, **k: (modes.append(k.get("mode", "sync")), process(*a, **k))[1]  # type: ignore
    eng._drafting_due = lambda: False  # type: ignore[method-assign]  # (1): every step async, none drafts
    eng.add_request("a", PROMPTS[3], sp)
    for _ in range(8):
        eng.step()
    eng.add_request("b", PROMPTS[1], sp)  # its prefill launches while "a" decodes
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert [list(outs[r].outputs[0].token_ids) for r in "ab"] == [greedy_ref[3][:24], greedy_ref[1][:24]]
    plain = [decode_only for g, decode_only in records if g == 0]
    assert plain and all(plain), records
    assert False in launched  # the case arose: b's prefill chunk was launched while a decode step was processed
    # (2): the policy always chooses gamma 0 at drafting steps; none of them runs synchronously.
    del eng._drafting_due
    eng.spec_policy.choose = lambda seq_ids, caps: 0  # type: ignore[method-assign]
    modes.clear()
    out = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert _ids(out) == [r[:24] for r in greedy_ref]
    assert "draft" not in modes and "drain" in modes, modes


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_adaptive_policy_drafts_only_in_steps_without_prefill_work(greedy_ref, async_scheduling):
    """A step that carries a prefill chunk runs eager and is never timed, so the adaptive policy does not draft
    into it (``SpecPolicy.drafting_due``): with gamma forced to 4, the decoding request drafts in decode-only
    steps and not in the step that also prefills a new request. Greedy output stays the plain output."""
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(speculative_config={**NGRAM, "adaptive": True}, async_scheduling=async_scheduling, **COMMON)
    eng = llm.engine
    eng.spec_policy.choose = lambda seq_ids, caps: 4  # type: ignore[method-assign]
    launched: list[tuple[bool, int, int]] = []  # (decode-only, sequences, drafts) per launched step
    launch = eng._launch

    def record(out):
        decode_only = all(s.num_scheduled_tokens == 1 + len(s.spec_token_ids) for s in out.scheduled)
        launched.append((decode_only, len(out.scheduled), sum(len(s.spec_token_ids) for s in out.scheduled)))
        return launch(out)

    eng._launch = record  # type: ignore[method-assign]
    eng.add_request("a", PROMPTS[0], sp)
    eng.step()  # a's prefill (with async scheduling: launched, not yet processed)
    eng.add_request("b", PROMPTS[1], sp)  # its prefill is scheduled while "a" decodes, and a has a draft
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert [list(outs[r].outputs[0].token_ids) for r in "ab"] == [greedy_ref[0][:24], greedy_ref[1][:24]]
    assert any(decode_only and drafts for decode_only, _, drafts in launched), launched
    assert any(not decode_only and n == 2 for decode_only, n, _ in launched), launched  # the case arose
    assert not any(drafts and not decode_only for decode_only, _, drafts in launched), launched


def test_without_async_scheduling_an_off_policy_does_not_propose_every_step(greedy_ref):
    """Without async scheduling (the CPU default) every step used to run the drafting path: n-gram lookups for
    every running request even while the policy kept speculation off (7% of a batch-32 step on the default model
    in bf16; 0.87-0.94x plain). Now, as with async scheduling, a step proposes only when ``drafting_due``: here
    the policy is held off, so only the steps where a probe is due propose (7 of 64 here), and the plain steps
    between them are timed for the policy. Greedy output stays the plain output."""
    from roofline.spec_decode.policy import PROBE_INTERVAL, PolicyDecision

    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm = LLM(speculative_config={**NGRAM, "adaptive": True}, async_scheduling=False, **COMMON)
    eng = llm.engine
    assert not eng.config.async_scheduling
    pol = eng.spec_policy

    def off(seq_ids, caps):  # the policy's off branch without its probe: gamma 0, the wait restarts when due
        pol.last = PolicyDecision(0, 1.0, len(seq_ids), 0.0, 0.0, 1.0)
        pol.seen.update(seq_ids)
        pol.steps_off = 0 if pol.steps_off + 1 >= pol.probe_interval else pol.steps_off + 1
        return 0

    pol.choose = off  # type: ignore[method-assign]
    calls: list[int] = []
    propose = eng.spec.propose
    eng.spec.propose = lambda running, waiting: (calls.append(1), propose(running, waiting))[1]  # type: ignore
    assert _ids(llm.generate(PROMPTS[1:2], sp, use_tqdm=False)) == [greedy_ref[1][:64]]
    # the first decode step, the probes, and a retry or two after a step that found no n-gram match
    assert 1 <= len(calls) <= 64 // PROBE_INTERVAL + 4, len(calls)  # 64 (every step) before
    assert 1 in pol.plain_s  # the plain synchronous steps were timed
