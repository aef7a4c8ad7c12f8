"""The n-gram proposer, the gamma policy and the counters (no model)."""

from __future__ import annotations

import pytest

from roofline.config import SpeculativeConfig
from roofline.spec_decode.ngram import ngram_propose
from roofline.spec_decode.policy import PROBE_INTERVAL, SpecPolicy
from roofline.spec_decode.stats import SpecDecodeStats


def test_ngram_takes_the_longest_suffix_and_its_latest_occurrence():
    #        0  1  2  3  4  5  6  7  8  9 10
    toks = [5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6]
    # suffix (5, 6) occurs at 0 and 5; the latest (5) is followed by 9, 2, 5
    assert ngram_propose(toks, 3, 1, 3) == [9, 2, 5]
    assert ngram_propose(toks, 10, 1, 3) == [9, 2, 5, 6]  # runs up to the end of the sequence
    # a length-3 suffix (2, 5, 6) has no earlier occurrence; min 3 means no draft
    assert ngram_propose(toks, 3, 3, 3) == []
    assert ngram_propose([1, 2, 3], 2, 1, 2) == []  # no repeat at all
    assert ngram_propose([4, 4], 3, 1, 1) == [4]
    assert ngram_propose(toks, 0, 1, 3) == []
    with pytest.raises(ValueError, match="lookup_min"):
        ngram_propose(toks, 2, 3, 2)


def _policy(adaptive=True, draft_cost=0.0, ratio=lambda b, g: 1.0, plain_timed=True):
    pol = SpecPolicy(gamma_max=4, adaptive=adaptive, verify_ratio=ratio, draft_cost=draft_cost)
    if plain_timed:  # plain steps timed at batch buckets 1..64 (the policy stays off where none was)
        for b in (1, 2, 4, 8, 16, 32, 64):
            pol.record_step(b, 0, 0.01)
    return pol


def test_policy_stays_off_until_a_plain_step_is_timed_at_the_batch_size():
    pol = _policy(plain_timed=False)
    for _ in range(10):
        pol.record(1, 4, 4)
    assert pol.choose([1], [4]) == 0
    pol.record_step(1, 0, 0.01)
    assert pol.choose([1], [4]) == 4  # the bound (verify is free) with a timed plain step: on
    assert pol.choose([1, 2, 3], [4, 4, 4]) == 0  # batch 3 (bucket 4): no plain step timed there


def test_policy_turns_on_for_high_acceptance_and_off_for_low():
    pol = _policy(draft_cost=0.3)
    for _ in range(10):
        pol.record(1, 4, 4)  # everything accepted
    assert pol.choose([1], [4]) >= 3
    pol2 = _policy(draft_cost=0.3)
    for _ in range(10):
        pol2.record(1, 4, 0)  # nothing accepted
    assert pol2.choose([1], [4]) == 0
    assert pol2.last is not None and pol2.last.predicted_speedup == 1.0


def test_policy_turns_off_when_verification_is_compute_bound():
    """At a batch where the verify pass costs gamma + 1 plain steps (compute-bound), nothing pays."""
    pol = _policy(ratio=lambda b, g: float(g + 1))
    for _ in range(10):
        pol.record(1, 4, 3)
    assert pol.choose([1], [4]) == 0
    pol_mem = _policy(ratio=lambda b, g: 1.0)  # memory-bound: the same acceptance pays
    for _ in range(10):
        pol_mem.record(1, 4, 3)
    assert pol_mem.choose([1], [4]) > 0


def test_policy_probes_while_off_and_pins_without_adaptive():
    pol = _policy(draft_cost=0.9)
    for _ in range(5):
        pol.record(1, 4, 0)
    gammas = [pol.choose([1], [4]) for _ in range(PROBE_INTERVAL)]
    assert gammas[:-1] == [0] * (PROBE_INTERVAL - 1) and gammas[-1] == 1
    assert _policy(adaptive=False).choose([1, 2], [4, 0]) == 4


def test_policy_says_when_steps_draft():
    """Drafting steps run synchronously, the others async: due before the first decision and while on; not
    while off until the probe (the skipped steps count toward it), nor during the doubling wait after steps
    with no draft; a new request in a small batch makes the next step draft, in a large one it waits."""
    pol = _policy(draft_cost=0.9)
    assert pol.drafting_due([1])
    for _ in range(5):
        pol.record(1, 4, 0)
    assert pol.choose([1], [4]) == 0
    due = []
    for _ in range(PROBE_INTERVAL - 1):
        due.append(pol.drafting_due([1]))
        if not due[-1]:
            assert pol.skip()  # an off step
    assert due == [False] * (PROBE_INTERVAL - 2) + [True]
    assert pol.choose([1], [4]) == 1  # the probe
    assert pol.drafting_due([1])  # on (gamma 1) until a decision says off again
    pol.last = None
    assert pol.choose([1], [4]) == 0
    assert not pol.drafting_due([1]) and pol.drafting_due([1, 2])  # request 2 is new, batch of 2
    assert not pol.drafting_due([1] + list(range(100, 120)))  # new requests in a batch of 21 wait
    pol.last = None  # as before a first decision: due whenever not waiting
    waits = []
    for _ in range(6):  # drafting steps that find no draft: waits of 1, 2, 4, 8, 16, 16 steps
        pol.no_drafts([1])
        n = 0
        while not pol.drafting_due([1]) and n < 100:
            pol.skip()
            n += 1
        waits.append(n)
    assert waits[:5] == [1, 2, 4, 8, 16] and waits[5] <= 16
    pol.choose([1], [4])  # a step with drafts resets the wait
    pol.no_drafts([1])
    assert pol.wait_steps == 1


def test_policy_alpha_estimate():
    """Accepted drafts over acceptance tests, both EMAs weighted per test, starting from a prior of 4 tests at
    0.5 (the request's prior is its proposer's alpha, here still 0.5)."""
    pol = _policy()
    pol.record(7, 4, 2)  # 2 accepted, then a rejection: 3 tests

    def estimate(w):  # prior 4 tests at 0.5 (scaled by w), then one pass of 3 tests weighing 1 - (1 - w)^3
        acc, tests, pw = 4 * w * 0.5, 4 * w, 1 - (1 - w) ** 3
        return ((1 - pw) * acc + pw * 2) / ((1 - pw) * tests + pw * 3)

    assert pol.alpha(7) == pytest.approx(estimate(0.05)) and 0.6 < pol.alpha(7) < 2 / 3
    assert pol.alpha(8) == pytest.approx(estimate(0.025))  # a new request starts from its proposer's
    prior = pol.alpha(8)
    pol.record(9, 1, 0)  # a first pass rejected at its first draft: alpha falls, but not to 0
    assert pol.alpha(9) == pytest.approx(4 * 0.05 * prior * 0.95 / (4 * 0.05 * 0.95 + 0.05)) and pol.alpha(9) > 0.45
    pol.forget(7)
    assert 7 not in pol.requests


def _simulate(pol, alpha, gamma_max, r, c, steps, seed):
    """Chain passes with per-token acceptance ``alpha`` (seeded): (tokens per unit time vs plain, steps on)."""
    import random
    rng = random.Random(seed)
    time = tokens = 0.0
    on = 0
    for _ in range(steps):
        g = pol.choose([1], [gamma_max])
        if g:
            acc = 0
            while acc < g and rng.random() < alpha:
                acc += 1
            pol.record(1, g, acc)
            time, tokens, on = time + r + g * c, tokens + acc + 1, on + 1
        else:
            time, tokens = time + 1, tokens + 1
    return tokens / time, on / steps


@pytest.mark.parametrize("alpha", [0.55, 0.3])
def test_adaptive_policy_keeps_a_winning_depth_1_drafter_on_and_a_losing_one_off(alpha):
    """A depth-1 tree (one acceptance test a pass) at verify ratio 1.2 and draft cost 0.18 per draft, as the
    EAGLE head on the CPU: break-even alpha 0.38; fixed gamma 1 is 1.55 / 1.38 = 1.12x plain at alpha 0.55
    and 0.94x at 0.3. Six seeds x 1,000 steps: at 0.55 the policy runs on 62% of steps for 1.080x (the rest
    is the estimate's noise near break-even: 15-step waits between probes), at 0.3 on 1-2% for ~1.0x. With
    alpha weighted 0.3 per pass and every probe that ended off doubling the wait (before 2026-12-05), alpha
    0.55 ran on 7% of steps for 1.011x (checked against that code): two rejections in a row turned it off and
    single-test probes rarely brought it back."""
    res = [_simulate(_policy(draft_cost=0.18, ratio=lambda b, g: 1.2), alpha, 1, 1.2, 0.18, 1000, seed)
           for seed in range(6)]
    speedup = sum(s for s, _ in res) / len(res)
    on = sum(o for _, o in res) / len(res)
    if alpha > 0.38:
        assert on > 0.55 and speedup > 0.95 * 1.55 / 1.38, (on, speedup)
    else:
        assert on < 0.05 and speedup > 0.99, (on, speedup)


def test_a_probe_near_break_even_does_not_double_the_probe_interval():
    """Probes cost little when the best gamma predicts near plain speed (>= 0.9x): the interval stays 16, so a
    request near break-even is re-tested often; a clearly losing one backs off (16, then 32)."""
    near = _policy(draft_cost=0.3)
    far = _policy(draft_cost=0.9)
    for pol in (near, far):
        for _ in range(40):
            pol.record(1, 1, 0)
        pol.requests[1].accepted = 0.25 * pol.requests[1].tests  # alpha 0.25: gamma 1 predicts 1.25 / 1.3
    gaps = {}
    for name, pol in (("near", near), ("far", far)):
        gammas = [pol.choose([1], [1]) for _ in range(3 * PROBE_INTERVAL + 1)]
        gaps[name] = [i for i, g in enumerate(gammas) if g]
    assert gaps["near"] == [PROBE_INTERVAL - 1, 2 * PROBE_INTERVAL - 1, 3 * PROBE_INTERVAL - 1], gaps
    assert gaps["far"] == [PROBE_INTERVAL - 1, 3 * PROBE_INTERVAL - 1], gaps


def test_stats_accounting():
    st = SpecDecodeStats()
    st.record(4, 2)
    st.record(2, 2)
    st.record(3, 0)
    assert st.num_emitted_tokens == st.num_accepted_tokens + st.num_drafts == 7
    assert st.acceptance_rate == pytest.approx(4 / 9)
    assert st.mean_acceptance_length == pytest.approx(7 / 3)
    assert st.accepted_per_position == [2, 2, 0, 0] and st.drafted_per_position == [3, 3, 2, 1]
    before = st.copy()
    st.record(1, 1)
    assert st.since(before).num_drafts == 1 and st.since(before).accepted_per_position[0] == 1
    assert st.draft_ms_per_step is None  # no step recorded yet
    st.num_steps_on, st.draft_seconds, st.verify_seconds = 4, 0.002, 0.010
    assert st.draft_ms_per_step == pytest.approx(0.5) and st.verify_ms_per_step == pytest.approx(2.5)
    assert st.since(before).verify_seconds == pytest.approx(0.010) and st.copy().draft_seconds == 0.002
    with pytest.raises(ValueError, match="accepted 3 of 2"):
        st.record(2, 3)


@pytest.mark.parametrize("cfg, match", [
    ({"method": "lookahead", "num_speculative_tokens": 2},
     "method must be one of ngram, draft_model, eagle, medusa, got 'lookahead'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 16\], got 0"),
    ({"method": "ngram", "num_speculative_tokens": True}, r"in \[1, 16\], got true$"),  # as written in JSON
    ({"method": "eagle", "num_speculative_tokens": 1, "tree_topk": False}, r"tree_topk .* got false$"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_layers": 3}, "num_layers applies to method 'draft_model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/x"},
     "model applies to method 'draft_model', 'eagle' and 'medusa', not 'ngram'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "or \"num_layers\" \\(a layer-truncated self\\)"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": ""}, "model must be a draft checkpoint path .*got ''"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/x", "num_layers": 3}, "does not combine with"),
    ({"method": "ngram", "num_speculative_tokens": 2, "gamma": 3}, "unknown key.*'gamma'; allowed: method"),
    ({"num_speculative_tokens": 2}, "needs 'method'"),
    ({"method": "nope"}, "method must be one of .*got 'nope'"),
    ({"method": {"x": 1}, "num_speculative_tokens": 2}, r"method must be one of .*got \{'x': 1\}"),
    ({"method": ["ngram"], "num_speculative_tokens": 2}, r"method must be one of .*got \['ngram'\]"),  # the bad method first, then the missing key
    ({"method": "ngram"}, r"needs 'num_speculative_tokens' \(gamma_max, .* an integer in \[1, 16\]"),
    # A learned head's bad path is named before the missing key (it is the bigger mistake).
    ({"method": "eagle", "model": "/nonexistent/head"}, "model '/nonexistent/head' does not exist: give an eagle head"),
    ("{not json", "not valid JSON"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, "adaptive must be true or false, got 'yes'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "num_layers": 0},
     r"num_layers must be an integer in \[1, the target's layers - 1\] .*got 0"),
    ('{"method": "eagle", "num_speculative_tokens": 2, "method": "ngram"}', "gives key 'method' more than once"),
])
def test_config_errors_name_the_value(cfg, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(cfg)


def test_policy_learns_the_measured_verify_cost_and_backs_off():
    """The bound says verification is free (memory-bound); measured steps say a verify pass costs 5 plain
    steps (an eager verify against a CUDA-graph decode, as on the H200). After one measured verify step the
    policy turns off, and its probes come at doubling intervals."""
    pol = _policy(draft_cost=0.0, plain_timed=False)
    for _ in range(10):
        pol.record(1, 4, 3)
    pol.record_step(1, 0, 0.005)
    assert pol.choose([1], [4]) == 4  # bound only (no verify step timed yet): on
    pol.record_step(1, 4, 0.025)
    assert pol.ratio(1, 4) == pytest.approx(5.0) and pol.ratio(1, 2) == pytest.approx(5.0)
    assert pol.choose([1], [4]) == 0
    gammas = [pol.choose([1], [4]) for _ in range(3 * PROBE_INTERVAL)]
    probes = [i for i, g in enumerate(gammas) if g]
    assert probes == [PROBE_INTERVAL - 2, 3 * PROBE_INTERVAL - 2], probes  # intervals 16, then 32


def test_lookup_defaults_and_draft_model_refuses_them():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 5)
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_min": 7}).prompt_lookup_max == 7
    with pytest.raises(ValueError, match="prompt_lookup_min applies to method 'ngram', not 'draft_model'"):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_layers": 4, "num_speculative_tokens": 2,
                                     "prompt_lookup_min": 2})


def test_policy_minimizes_mean_tpot_not_batch_throughput():
    """Batch 4 with a measured verify ratio of 1.6: one request copies (alpha ~1, 5 tokens per pass at gamma 4),
    three have no draft. Throughput would rise ((5 + 3) / 4 = 2 tokens per request-step > 1.6), but the three
    wait 1.6 plain steps for their one token: mean TPOT 1.6 x (1/5 + 3) / 4 = 1.28 plain steps, so it stays
    off. With all four copying, mean TPOT is 1.6 / 5 = 0.32 and it turns on."""
    pol = _policy()
    pol.record_step(4, 4, 0.016)  # plain steps at bucket 4 took 0.01 s (_policy): measured ratio 1.6
    for sid in (1, 2, 3, 4):
        for _ in range(10):
            pol.record(sid, 4, 4)
    assert pol.ratio(4, 4) == pytest.approx(1.6)
    assert pol.choose([1, 2, 3, 4], [4, 0, 0, 0]) == 0
    assert pol.choose([1, 2, 3, 4], [4, 4, 4, 4]) == 4
    assert pol.last is not None and pol.last.predicted_speedup == pytest.approx(1 / (1.6 / 4.99), rel=1e-2)


def test_policy_takes_the_measured_excess_from_the_nearest_bucket():
    """Before a verify step is timed at a bucket, the excess measured at the nearest bucket applies (a host-bound
    verify step costing 4 plain ones at batch 16 is not free at batch 32); with none timed, the bound alone."""
    pol = _policy()
    assert pol.ratio(32, 4) == 1.0
    pol.record_step(16, 4, 0.04)  # bucket 16: verify 4x plain
    assert pol.ratio(32, 4) == pytest.approx(4.0) and pol.ratio(2, 4) == pytest.approx(4.0)
    pol.record_step(64, 4, 0.02)  # bucket 64: 2x; 32 is as near to 16 as to 64, the smaller bucket wins a tie
    assert pol.ratio(32, 4) == pytest.approx(4.0) and pol.ratio(64, 4) == pytest.approx(2.0)
    pol.record_step(32, 4, 0.03)  # its own bucket, once timed
    assert pol.ratio(32, 4) == pytest.approx(3.0)


def test_policy_charges_the_refill_to_the_newest_verify_timing():
    """The async step launched after a drafting step hides behind nothing: its host time is added to the
    drafting step's verify timing at that timing's EMA weight (all of it for a bucket's first timing), once."""
    pol = _policy()
    pol.record_step(16, 4, 0.03)  # first verify timing at (16, 4): weight 1
    pol.record_refill(16, 4, 0.006)
    assert pol.verify_s[(16, 4)] == pytest.approx(0.036)
    pol.record_refill(16, 4, 0.006)  # charged once per drafting step
    assert pol.verify_s[(16, 4)] == pytest.approx(0.036)
    pol.record_step(16, 4, 0.02)  # EMA: 0.8 * 0.036 + 0.2 * 0.02 = 0.0328; the refill at weight 0.2
    pol.record_refill(16, 4, 0.01)
    assert pol.verify_s[(16, 4)] == pytest.approx(0.0328 + 0.2 * 0.01)
    pol.record_step(16, 4, 0.02)
    pol.record_refill(16, 2, 0.01)  # not the newest verify timing's key: ignored
    assert pol.verify_s[(16, 4)] == pytest.approx(0.8 * 0.0348 + 0.2 * 0.02)
    assert pol.ratio(16, 4) == pytest.approx(pol.verify_s[(16, 4)] / 0.01)


def test_adaptive_policy_does_not_draft_into_a_step_with_prefill_work():
    pol = _policy()
    assert pol.drafting_due([1, 2]) and not pol.drafting_due([1, 2], prefill_pending=True)
    assert _policy(adaptive=False).drafting_due([1, 2], prefill_pending=True)  # a pinned gamma always drafts


def test_a_probe_re_measures_so_one_slow_verify_step_does_not_keep_the_policy_off():
    """Plain steps take 1 ms and verify steps 1.5 ms at every gamma (ratio 1.5), acceptance 0.9: gamma 4 pays
    (E = 4.1 tokens per pass). The first gamma-4 step hits a 20 ms hiccup, which prices gamma 4 at r = 20 and
    gamma 1-3 at the same excess: off. The probe after PROBE_INTERVAL steps off measures gamma 1 at 1.5 ms; it
    replaces the estimate (not an EMA step) and drops the stale gamma-4 timing, so the policy is back at gamma
    4 right after the first probe. Blending the probe into the EMA, as every other timing, kept it off for all
    400 steps (probes at gamma 1 never re-time gamma 4; checked against the code before this test)."""
    pol = _policy(plain_timed=False)
    for _ in range(10):
        pol.record(1, 4, 4)
        pol.record(1, 4, 3)
    pol.record_step(1, 0, 0.001)
    assert pol.choose([1], [4]) == 4
    pol.record_step(1, 4, 0.020)  # the hiccup
    gammas = []
    for _ in range(400):
        g = pol.choose([1], [4])
        gammas.append(g)
        pol.record_step(1, g, 0.0015 if g else 0.001)
    on = [i for i, g in enumerate(gammas) if g == 4]
    assert gammas[:PROBE_INTERVAL - 1] == [0] * (PROBE_INTERVAL - 1) and gammas[PROBE_INTERVAL - 1] == 1
    assert on and on[0] == PROBE_INTERVAL and len(on) == 400 - PROBE_INTERVAL, (on[:3], len(on))
    assert pol.ratio(1, 4) == pytest.approx(1.5)


def test_the_policy_says_once_why_it_turned_speculation_off(caplog):
    """A verify pass priced like a 16-node tree (ratio 3) loses at every gamma: one INFO line says so, with the
    best gamma's prediction and the verify ratio, and later off steps add none."""
    import logging

    pol = _policy(ratio=lambda b, g: 3.0)
    with caplog.at_level(logging.INFO, logger="roofline.spec_decode.policy"):
        for _ in range(3):
            assert pol.choose([0], [4]) == 0
    lines = [r.getMessage() for r in caplog.records if "speculative decoding off" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "verify ratio 3.000" in lines[0] and "batch 1" in lines[0]


def test_draft_cost_is_measured_in_plain_target_steps():
    """c prices a draft step in plain steps (the formula adds gamma c to the verify ratio): a 2 ms draft step
    against a 10 ms plain step (timed at the batch's bucket) is 0.2, whatever the 12 ms verify pass took;
    before a plain step is timed at that bucket, the verify pass stands in for it."""
    pol = _policy(draft_cost=0.0)
    for _ in range(60):
        pol.record_cost(0.002, 1, 0.012)
    assert pol.draft_cost == pytest.approx(0.2, rel=1e-4)
    fresh = _policy(draft_cost=0.0, plain_timed=False)
    for _ in range(60):
        fresh.record_cost(0.003, 1, 0.012)
    assert fresh.draft_cost == pytest.approx(0.25, rel=1e-4)


@pytest.mark.parametrize("verify_ratio,draft_cost,wait", [(1.2, 0.18, 19), (20.0, 1.8, 1024)],
                         ids=["cpu_eagle", "eager_gpu_tree"])
def test_a_probe_waits_long_enough_to_cost_at_most_the_probe_budget(verify_ratio, draft_cost, wait):
    """After a probe's verify timing arrives, the next probe waits at least (r + c - 1) / PROBE_BUDGET steps:
    r 1.2, c 0.18 (the CPU EAGLE head's figures) waits ceil(0.38 / 0.02) = 19 steps instead of 16; an eager
    tree verify at 20 plain steps with c 1.8 (an H100, 2026-12-05) waits the most, 1,024."""
    pol = _policy(draft_cost=draft_cost, ratio=lambda b, g: 1.0)
    pol.record(1, 1, 0)  # alpha well below break-even: off
    pol.requests[1].accepted = 0.1 * pol.requests[1].tests
    gammas = [pol.choose([1], [1]) for _ in range(PROBE_INTERVAL)]
    assert gammas[-1] == 1 and sum(gammas) == 1  # the first probe, after 16 steps off
    pol.record_step(1, 1, 0.01 * verify_ratio)  # its verify pass, timed (plain steps take 0.01 s)
    assert pol.probe_interval == wait
    gammas = [pol.choose([1], [1]) for _ in range(wait)]
    assert gammas.index(1) == wait - 1 and sum(gammas) == 1


@pytest.mark.parametrize("respect_steady", [True, False], ids=["catch_up_apart", "catch_up_in_c"])
def test_a_drafts_catch_up_after_steps_off_does_not_price_its_steady_draft_cost(respect_steady):
    """A draft with state of its own (EAGLE's layer, a separate draft's KV) first reads every position the target
    computed since it last drafted: a request's prompt at its first draft, the steps spent off at a probe. On the
    CPU (Intel Xeon, bf16, the EAGLE head at depth 1, 2026-12-06) a probe's draft took 10.3 ms against 2.75 ms a
    steady one, a plain step 13.3 ms and the verify 15.5 ms (r 1.17, c 0.21, alpha 0.62: 1.10x plain fixed).
    Modelled here as c(k rows) = 0.18 + 0.035 k plain steps, a 100-token prompt first. Reported as not steady
    (``record_cost(..., steady=False)``, as the controller does past 1 + gamma_max rows) the catch-up stays out of
    c and the drafter stays on; counted in c, as before 2026-12-06, the prompt's catch-up turns it off and every
    probe's catch-up keeps it off (measured then: on in 6 of 2,029 steps, 0.97x)."""
    import random

    rng = random.Random(0)
    pol = SpecPolicy(gamma_max=1, adaptive=True, verify_ratio=lambda b, g: 1.17, draft_cost=0.067)
    pol.record_step(1, 0, 0.01)  # a plain step, timed
    time_, tokens, on, since = 0.0, 0, 0, 100  # rows the draft has not read: the prompt
    for _ in range(2000):
        if pol.choose([1], [1]):
            acc = int(rng.random() < 0.62)
            pol.record(1, 1, acc)
            c = 0.18 + 0.035 * since
            pol.record_cost(0.01 * c, 1, 0.0117, since <= 2 or not respect_steady)
            pol.record_step(1, 1, 0.0117)
            time_, tokens, on, since = time_ + 1.17 + c, tokens + 1 + acc, on + 1, 1 + acc
        else:
            time_, tokens, since = time_ + 1.0, tokens + 1, since + 1
    if respect_steady:
        assert on > 1800 and tokens / time_ > 1.05, (on, tokens / time_)
        assert pol.draft_cost == pytest.approx(0.18 + 0.035 * 1.62, abs=0.03)
    else:
        assert on < 100 and tokens / time_ < 1.01, (on, tokens / time_)


def test_a_tree_policy_chooses_only_off_or_the_whole_tree():
    """A token tree drafts its whole shape whenever it drafts, and every verify timing is the whole tree's
    (the controller keys it at the tree's depth). So the policy of a depth-2 tree picks 0 or 2, probes at 2, and a
    cheap gamma-1 timing (taken once: on the CPU, 2026-12-06, 37.8 ms against 58.6 ms for the tree's verify pass
    each step since) cannot keep a losing tree on: verify ratio 1.5, c 0.2 a depth, alpha 0.5 is
    E(0.5, 2) / (1.5 + 0.4) = 0.92x plain. A chain still prices every gamma."""
    tree = SpecPolicy(gamma_max=2, adaptive=True, verify_ratio=lambda b, g: 1.0, draft_cost=0.2, tree=True)
    chain = SpecPolicy(gamma_max=2, adaptive=True, verify_ratio=lambda b, g: 1.0, draft_cost=0.2)
    for pol in (tree, chain):
        pol.record_step(1, 0, 0.010)  # a plain step
        pol.record_step(1, 1, 0.0105)  # a cheap gamma-1 timing
        pol.record_step(1, 2, 0.015)  # the tree's (or the chain's gamma 2) verify pass
        for _ in range(40):
            pol.record(1, 2, 1)  # alpha 0.5
    gammas = [tree.choose([1], [2]) for _ in range(PROBE_INTERVAL)]
    assert gammas[:-1] == [0] * (PROBE_INTERVAL - 1) and gammas[-1] == 2  # off, then a probe of the whole tree
    assert tree.last.verify_ratio == pytest.approx(1.5)
    assert chain.choose([1], [2]) == 1  # (1.05 + 0.2) against 1.5 tokens: 1.2x, from the gamma-1 timing


def test_a_verify_step_is_a_decode_step_of_the_run_summary():
    """``EngineStats``: a step whose sequences each scheduled their next token and their drafts (no prefill work)
    counts toward the summary's mean decode step, with its keys read; one with a prefill chunk does not."""
    from types import SimpleNamespace

    from roofline.engine.scheduler import ScheduledSequence, SchedulerOutput
    from roofline.engine.stats import EngineStats

    def chunk(start, n, drafts=0):  # start and preemptions given: the chunk reads no sequence
        return ScheduledSequence(None, n, start_position=start, num_preemptions=0, spec_token_ids=[0] * drafts)

    sched = SimpleNamespace(num_preemptions=0)
    st = EngineStats()
    for scheduled, dt in (([chunk(10, 1), chunk(20, 1)], 0.01),  # plain decode
                          ([chunk(11, 4, 3), chunk(21, 1)], 0.03),  # a verify step beside a plain row
                          ([chunk(0, 8), chunk(22, 1)], 0.05)):  # a prefill chunk: not a decode step
        st.record_step(SchedulerOutput(scheduled), dt, sched, None)
    assert (st.num_steps, st.num_decode_steps) == (3, 2)
    assert st.decode_time_s == pytest.approx(0.04) and st.decode_seqs == 4
    assert st.decode_kv_tokens == (11 + 21) + (15 + 22)


def test_config_null_means_the_default():
    # JSON null for an optional key is its default, as vLLM reads it: adaptive as well as the n-gram window
    cfg = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 2, "adaptive": null, '
                                      '"prompt_lookup_min": null}')
    assert cfg.adaptive is True and cfg.prompt_lookup_min == 2 and cfg.prompt_lookup_max == 5
