"""When to speculate, and how far: gamma per step from the bound model and measured rates.

Each step, for the B requests that decode, the policy picks the gamma in ``0 .. gamma_max`` that minimizes the
predicted mean time per output token (TPOT) over those requests,

    (verify_ratio(B, gamma) + gamma * c) * mean_i 1 / E(alpha_i, min(gamma, cap_i))      [gamma = 0: 1]

in units of one plain decode step. A request that cannot speculate this step (no draft, no room, penalties)
has cap 0 and E = 1: it pays the longer step and gains nothing. This is the serving metric (each request's
TPOT, averaged over requests), not the batch's token throughput ``sum_i E_i / (ratio + gamma c)``: by the
harmonic-arithmetic mean inequality a gamma that lowers the predicted mean TPOT never lowers the predicted
throughput, while a throughput gain can come from a few copying requests at the others' expense.

- ``E(alpha, gamma) = (1 - alpha^(gamma+1)) / (1 - alpha)``: expected tokens per verify pass with a per-token
  acceptance rate alpha (Leviathan et al. 2023, eq. 1; ``costmodel.expected_tokens_per_step``);
- ``alpha_i``: request i's acceptance, accepted drafts over acceptance tests (a pass that stops at a rejection
  counts one failed test), both exponential moving averages weighted per test (``ALPHA_TEST_EMA``), from a
  prior of ``PRIOR_TESTS`` tests at its proposer's running alpha; a request with no pass yet takes that;
- ``c``: one draft step's time over one target step's, from the engine's own step timings (an EMA) of steady
  drafting steps only: a draft with state of its own first catches up over the positions computed while it was
  off (a probe, a prompt), which prices the probe's wait instead (``record_cost``);
- ``verify_ratio(B, gamma)``: the bound model's step time at ``B x (gamma + 1)`` positions over
  ``B x 1`` (``costmodel.verify_cost_ratio``), with the device's measured read bandwidth and GEMM rate:
  1 while the step is memory-bound, growing once the verify pass turns compute-bound. The bound is a floor:
  the engine also reports its measured plain-decode and verify step times (``record_step``, per batch-size
  bucket), and the ratio used is the bound times the measured excess ``(verify / plain) / bound``, taken at
  the batch's bucket or, before a verify step was timed there, at the nearest bucket where one was (at the
  llama-3-8b shape on the H200, with both steps replaying CUDA graphs: measured r = 1.20 at batch 1 and
  gamma 1 where the bound says 1.0; on the default 135M model behind the server, whose steps are host-bound,
  a synchronous verify step measured 3-4 asynchronous plain steps).

Until a plain step has been timed at the batch's size bucket, gamma is 0 (with the bound alone the policy
would stay on and never see what a plain step costs: measured at 32 concurrent requests on the H200, TPOT
2.5x the plain server's). gamma = 0 turns speculation off for the step. While it is off, a probe step
speculates with gamma 1 (a token tree: its whole shape, gamma_max) so the estimates keep up (a copy-heavy request can start later): after
``PROBE_INTERVAL`` steps off; while the best gamma predicts below ``PROBE_BACKOFF_BELOW`` x plain (a clear
loss), twice as many each time a probe ends off again, up to ``MAX_PROBE_INTERVAL``; near break-even a probe
costs little and the interval returns to ``PROBE_INTERVAL``. Either way, once a probe's verify timing arrives
the wait before the next one is at least the probe's measured extra cost over the plain step it replaced
(verify ratio + c - 1, in plain steps) divided by ``PROBE_BUDGET``, so probes take about 2% of the time at
most: on an H100 an eager EAGLE tree probe cost ~30 plain steps of the 135M model (~1,500 steps' wait),
where a CPU probe at r 1.2, c 0.18 costs 0.38 (19 steps). A probe re-measures its batch bucket from scratch: when its verify timing arrives,
the bucket's verify timings at every gamma are dropped and the probe's becomes the first, so the next decision
prices every gamma from the probe's excess (nearest gamma). Otherwise one slow early verify step
(a host hiccup) would keep its gamma priced off for good: only a chosen gamma is ever timed, and probes come
at ever longer intervals. With ``adaptive`` False gamma is always gamma_max. Step times are wall times (the
engine's host work, the n-gram proposer's and the processing of the step's tokens included): a step that
drafts runs synchronously, while the plain steps between probes run with async scheduling (``drafting_due``),
so the measured excess also prices the lost overlap, including the async step after a drafting one, which
launches with nothing in flight (``record_refill``). Only decode-only steps are timed, so the adaptive policy
drafts only in steps that carry no prefill work.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from roofline.costmodel import expected_tokens_per_step

logger = logging.getLogger(__name__)

ALPHA_PRIOR = 0.5  # a proposer's acceptance before its first verify pass
PRIOR_TESTS = 4  # the prior (ALPHA_PRIOR, or for a request its proposer's alpha) counts as this many tests
ALPHA_TEST_EMA = 0.05  # a verify pass with t acceptance tests weighs 1 - (1 - this)^t in a request's alpha
PROPOSER_TEST_EMA = 0.025  # the same per test for the proposer's running alpha (a new request's prior)
COST_EMA = 0.2  # weight of the newest measurement in the draft-cost estimate
PROBE_INTERVAL = 16  # steps with gamma 0 before the first probe at gamma 1
MAX_PROBE_INTERVAL = 1024  # the probe interval doubles while clearly losing probes keep ending off, up to this
PROBE_BACKOFF_BELOW = 0.9  # a probe doubles the interval only if the best gamma predicted below this x plain
PROBE_BUDGET = 0.02  # after a probe, the wait is at least its measured extra cost / this (probes <= ~2% of time)
NEW_REQUEST_BATCH = 8  # while off, a new request in a decode batch this small makes the next step draft
MAX_NO_DRAFT_WAIT = 16  # most steps without proposals after repeated drafting steps that found no draft
ALPHA_MAX = 0.999  # E(alpha) needs alpha < 1


@dataclass
class _Acceptance:
    """EMA of accepted drafts and of acceptance tests; alpha = accepted / tests."""

    accepted: float = 0.0
    tests: float = 0.0

    def update(self, num_draft: int, num_accepted: int, test_weight: float, prior: float) -> None:
        """One verify pass: ``num_accepted`` of ``num_draft`` drafts (along the accepted path of a tree). It is
        ``num_accepted`` tests passed plus one failed if it stopped at a rejection, and weighs
        ``1 - (1 - test_weight)^tests``: per test, not per pass, so a depth-1 tree's single Bernoulli test moves
        alpha as little as one test of a chain does (per pass at weight 0.3, alpha's standard deviation at a
        true 0.55 was ~0.21 for one test a pass, and two rejections in a row turned a winning drafter off).
        The estimate starts as one test at ``prior`` (the proposer's alpha for a request), so a first pass
        that stops at its first draft does not set alpha to 0 (only probes would then move it)."""
        tests = num_accepted + (1 if num_accepted < num_draft else 0)
        weight = 1.0 - (1.0 - test_weight) ** tests
        if self.tests == 0.0:
            self.accepted, self.tests = PRIOR_TESTS * test_weight * prior, PRIOR_TESTS * test_weight
        self.accepted = (1 - weight) * self.accepted + weight * num_accepted
        self.tests = (1 - weight) * self.tests + weight * tests

    @property
    def alpha(self) -> float | None:
        return None if self.tests <= 0 else min(self.accepted / self.tests, ALPHA_MAX)


@dataclass
class PolicyDecision:
    gamma: int
    predicted_speedup: float  # predicted mean TPOT at gamma 0 over that at gamma
    batch: int
    mean_alpha: float
    draft_cost: float
    verify_ratio: float


@dataclass
class SpecPolicy:
    """Picks gamma per step (``choose``) and learns from verify passes (``record``) and timings (``record_cost``).

    ``verify_ratio(batch, gamma)`` comes from the bound model (see the module docstring); ``draft_cost`` is the
    starting estimate of c (0 for n-gram, k / num_layers for a k-layer self-draft).
    """

    gamma_max: int
    adaptive: bool
    verify_ratio: Callable[[int, int], float]
    draft_cost: float = 0.0
    # A token tree drafts its whole shape (depth gamma_max, tree_budget nodes) whenever it drafts, so the only
    # choices are off and gamma_max, and every verify timing is the whole tree's. Pricing gamma 1 from a timing
    # taken once and never again kept a losing depth-2 tree on (CPU, 2026-12-06).
    tree: bool = False
    proposer: _Acceptance = field(default_factory=_Acceptance)
    requests: dict[int, _Acceptance] = field(default_factory=dict)
    steps_off: int = 0
    probe_interval: int = PROBE_INTERVAL
    last: PolicyDecision | None = None
    # Measured step seconds (EMA) per batch bucket (next power of two): plain decode, and verify per gamma.
    plain_s: dict[int, float] = field(default_factory=dict)
    verify_s: dict[tuple[int, int], float] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)  # requests a decision has covered (until forgotten)
    wait_steps: int = 0  # steps to run without proposing after drafting steps that found no draft
    no_draft_backoff: int = 1  # the next such wait (doubles up to MAX_NO_DRAFT_WAIT)
    _last_verify: tuple[tuple[int, int], float] | None = None  # the newest verify timing's key and EMA weight
    _probing: bool = False  # the next verify timing is a probe's: it re-measures its bucket (record_step)
    _off_logged: bool = False  # the reason speculation went off was logged (once per policy)
    catch_up_cost: float = 0.0  # the newest draft step that caught up after steps off, in plain steps (record_cost)

    def drafting_due(self, decoding: list[int], prefill_pending: bool = False) -> bool:
        """Whether the next step, whose decoding requests are ``decoding``, should propose drafts. The engine
        runs steps that propose synchronously and the others with async scheduling (``skip`` counts them).
        Due: always with a fixed gamma; otherwise not when the step will carry prefill work
        (``prefill_pending``: such a step runs eager, so its verify rows are not the CUDA-graph verify step
        the timings price, and it is never timed: measured on the H200 behind the server, a drafting step with
        a prefill chunk took 43 ms against 12 ms for an async one, `bench/results/spec-20261202d/`), not while
        waiting after a step with no draft (``no_drafts``), and then while speculation is on (or before the
        first decision), when a probe is due, or when a request no decision has covered decodes in a batch of
        at most ``NEW_REQUEST_BATCH`` (small batches are where speculation pays; a large batch waits for the
        next probe)."""
        if not self.adaptive:
            return True
        if prefill_pending or self.wait_steps > 0:
            return False
        if self.last is None or self.last.gamma > 0 or self.steps_off + 1 >= self.probe_interval:
            return True
        return 0 < len(decoding) <= NEW_REQUEST_BATCH and any(s not in self.seen for s in decoding)

    def skip(self) -> bool:
        """A step that ran without proposing. Returns whether speculation was off (a step closer to a probe)
        rather than waiting after a step with no draft."""
        if self.wait_steps > 0:
            self.wait_steps -= 1
        off = self.last is not None and self.last.gamma == 0
        self.steps_off += off
        return off

    def no_drafts(self, seq_ids: list[int]) -> None:
        """A drafting step where no request (of ``seq_ids``) had a draft (no n-gram match): the next
        ``no_draft_backoff`` steps do not propose, and the wait doubles while such steps repeat, up to
        ``MAX_NO_DRAFT_WAIT``."""
        self.seen.update(seq_ids)
        self.wait_steps = self.no_draft_backoff
        self.no_draft_backoff = min(2 * self.no_draft_backoff, MAX_NO_DRAFT_WAIT)

    @staticmethod
    def _bucket(batch: int) -> int:
        return 1 << max(0, (batch - 1).bit_length())

    def record_step(self, batch: int, gamma: int, seconds: float) -> None:
        """A step with ``batch`` decoding requests and no prefill: plain (gamma 0) or verify (its target
        pass only, draft time excluded)."""
        if seconds <= 0 or batch <= 0:
            return
        key: int | tuple[int, int] = self._bucket(batch)
        table: dict = self.plain_s
        if gamma > 0:
            key, table = (self._bucket(batch), gamma), self.verify_s
        if gamma > 0 and self._probing:  # a probe's timing: the bucket re-measured (see the module docstring)
            self._probing = False
            for k in [k for k in self.verify_s if k[0] == key[0]]:
                del self.verify_s[k]
            plain = self.plain_s.get(key[0])
            if plain:  # the wait that keeps probes within PROBE_BUDGET of the time
                extra = seconds / plain + gamma * max(self.draft_cost, self.catch_up_cost) - 1.0
                floor = min(math.ceil(extra / PROBE_BUDGET), MAX_PROBE_INTERVAL)
                self.probe_interval = max(self.probe_interval, floor)
        old = table.get(key)
        weight = 1.0 if old is None else COST_EMA
        table[key] = weight * seconds + (1 - weight) * (old or 0.0)
        if gamma > 0:
            self._last_verify = (key, weight)

    def record_refill(self, batch: int, gamma: int, seconds: float) -> None:
        """The host time of the async step launched right after a drafting step (``batch`` requests, ``gamma``):
        with no step in flight it hides behind nothing, a cost of leaving the synchronous drafting step. It is
        added to that step's newest verify timing, at the weight that timing had in the EMA."""
        key = (self._bucket(batch), gamma)
        if seconds > 0 and self._last_verify is not None and self._last_verify[0] == key:
            self.verify_s[key] += self._last_verify[1] * seconds
            self._last_verify = None

    def ratio(self, batch: int, gamma: int) -> float:
        """The verify ratio used for decisions: the bound, scaled by the measured excess (see the module
        docstring), from the batch's bucket, else the nearest bucket with a timed verify step, else none."""
        bound = self.verify_ratio(batch, gamma)
        b = self._bucket(batch)
        # (bucket distance in doublings, gamma distance, bucket, gamma, verify / plain) per timed verify step
        measured = [((bb.bit_length() - b.bit_length()) ** 2, abs(g - gamma), bb, g, t / self.plain_s[bb])
                    for (bb, g), t in self.verify_s.items() if bb in self.plain_s]
        if not measured:
            return bound
        _, _, bb, g, r = min(measured)
        excess = r / self.verify_ratio(batch if bb == b else bb, g)
        return bound * max(excess, 1.0)

    def alpha(self, seq_id: int) -> float:
        own = self.requests.get(seq_id)
        a = own.alpha if own is not None else None
        if a is None:
            a = self.proposer.alpha
        return ALPHA_PRIOR if a is None else a

    def choose(self, seq_ids: list[int], caps: list[int]) -> int:
        """gamma for this step, given the decoding requests and each one's cap (drafts available, room to
        max_tokens / max_model_len; 0 for a request that may not speculate)."""
        b = len(seq_ids)
        if b == 0:
            return 0
        if not self.adaptive:
            self.last = PolicyDecision(self.gamma_max, float("nan"), b, float("nan"), self.draft_cost,
                                       float("nan"))
            return self.gamma_max
        self.seen.update(seq_ids)
        self.no_draft_backoff = 1
        alphas = [self.alpha(s) for s in seq_ids]
        best = PolicyDecision(0, 1.0, b, sum(alphas) / b, self.draft_cost, 1.0)
        # No plain step measured at this batch size yet: stay off (its plain steps then run, and are timed)
        # rather than trust the bound, which alone would keep speculation on with nothing to compare it to.
        measured = self._bucket(b) in self.plain_s
        top: PolicyDecision | None = None  # the best gamma >= 1, for the log line when it loses
        for g in range(self.gamma_max if self.tree else 1, self.gamma_max + 1 if measured else 1):
            if max(caps) < 1:
                break
            ratio = self.ratio(b, g)
            # Mean over requests of 1 / tokens per step: each request's TPOT in units of the step's time.
            per_token = sum(1.0 / expected_tokens_per_step(a, min(g, cap))
                            for a, cap in zip(alphas, caps, strict=True)) / b
            speedup = 1.0 / ((ratio + g * self.draft_cost) * per_token)
            if top is None or speedup > top.predicted_speedup:
                top = PolicyDecision(g, speedup, b, best.mean_alpha, self.draft_cost, ratio)
            if speedup > best.predicted_speedup:
                best = PolicyDecision(g, speedup, b, best.mean_alpha, self.draft_cost, ratio)
        if best.gamma == 0:
            if top is not None and not self._off_logged:
                self._off_logged = True
                logger.info("speculative decoding off (adaptive policy): the best gamma %d predicts %.3fx plain at "
                            "batch %d (verify ratio %.3f, draft cost c %.3f per draft, mean alpha %.3f); it probes "
                            "again every %d+ steps (a large tree's verify pass prices all its nodes)",
                            top.gamma, top.predicted_speedup, b, top.verify_ratio, top.draft_cost, top.mean_alpha,
                            self.probe_interval)
            self.steps_off += 1
            if self.steps_off >= self.probe_interval and max(caps) >= 1:
                self.steps_off = 0
                if top is None or top.predicted_speedup < PROBE_BACKOFF_BELOW:
                    self.probe_interval = min(2 * self.probe_interval, MAX_PROBE_INTERVAL)
                else:  # near break-even a probe costs little: keep testing often
                    self.probe_interval = PROBE_INTERVAL
                self._probing = True  # its timing re-measures the bucket (record_step)
                g = self.gamma_max if self.tree else 1
                best = PolicyDecision(g, best.predicted_speedup, b, best.mean_alpha, self.draft_cost, self.ratio(b, g))
        else:
            self.steps_off = 0
            if best.predicted_speedup > 1.0:
                self.probe_interval = PROBE_INTERVAL
        self.last = best
        logger.debug("spec policy: gamma %d (predicted %.3fx; batch %d, mean alpha %.3f, c %.3f, verify ratio %.3f)",
                     best.gamma, best.predicted_speedup, b, best.mean_alpha, best.draft_cost, best.verify_ratio)
        return best.gamma

    def record(self, seq_id: int, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        prior = self.proposer.alpha
        self.requests.setdefault(seq_id, _Acceptance()).update(
            num_draft, num_accepted, ALPHA_TEST_EMA, ALPHA_PRIOR if prior is None else prior)
        self.proposer.update(num_draft, num_accepted, PROPOSER_TEST_EMA, ALPHA_PRIOR)

    def record_cost(self, draft_step_s: float, batch: int, verify_step_s: float, steady: bool = True) -> None:
        """One draft step's seconds at ``batch`` decoding requests, from a step whose verify pass took
        ``verify_step_s``. c is in plain target steps: over the plain step timed at the batch's bucket, or,
        before one was, over the verify pass (which overstates the plain step by the verify ratio).

        ``steady`` False: the draft first caught up over more positions than a drafting step leaves behind
        (a probe after steps off, or a request's first draft after its prompt: a draft model or EAGLE layer
        reads every position the target computed since it last drafted). That time is what being off costs
        at the next probe, not what a drafting step costs while on, so it does not move c; it prices the
        probe's wait instead (``record_step``). Measured on the CPU (Intel Xeon, bf16, EAGLE depth 1): 10.3 ms
        a probe's draft against 2.75 ms a steady one, and with it in c (0.78 plain steps instead of 0.21) the
        policy kept a 1.10x drafter off in 2,023 of 2,029 steps."""
        target_step_s = self.plain_s.get(self._bucket(batch), verify_step_s)
        if target_step_s <= 0:
            return
        if steady:
            self.draft_cost = (1 - COST_EMA) * self.draft_cost + COST_EMA * draft_step_s / target_step_s
        else:
            self.catch_up_cost = draft_step_s / target_step_s

    def forget(self, seq_id: int) -> None:
        self.requests.pop(seq_id, None)
        self.seen.discard(seq_id)
