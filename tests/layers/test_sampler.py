"""Sampler: masks and penalties against plain-Python references, seeded reproducibility, the sampled
distribution against softmax(logits / T) within a stated statistical tolerance, greedy, and logprobs.
"""

from __future__ import annotations

import math

import pytest
import torch

from roofline.layers.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    apply_top_k_top_p_min_p,
    nonfinite_rows,
    token_logprobs,
)


def make_md(n: int, temperatures: list[float] | None = None, *, top_ks=None, top_ps=None, min_ps=None,
            repetition=None, presence=None, frequency=None, prompt_mask=None, output_counts=None,
            banned=None, generators=None, max_num_logprobs: int = -1) -> SamplingMetadata:
    """Metadata as the ModelRunner builds it: ``None`` for a feature no row uses."""
    temps = temperatures if temperatures is not None else [1.0] * n

    def col(values, dtype=torch.float32):
        return None if values is None else torch.tensor(values, dtype=dtype)

    return SamplingMetadata(
        temperatures=col(temps),
        top_ks=col(top_ks, torch.int64),
        top_ps=col(top_ps),
        min_ps=col(min_ps),
        repetition_penalties=col(repetition),
        presence_penalties=col(presence),
        frequency_penalties=col(frequency),
        prompt_mask=prompt_mask,
        output_counts=output_counts,
        banned_mask=banned,
        generators=generators if generators is not None else [None] * n,
        all_greedy=all(t == 0.0 for t in temps),
        max_num_logprobs=max_num_logprobs,
    )


# --------------------------------------------------------------------------------------------------
# top-k / top-p / min-p masks
# --------------------------------------------------------------------------------------------------

def ref_kept(row: list[float], top_k: int, top_p: float, min_p: float) -> tuple[set[int], float]:
    """Tokens a row keeps, in float64 Python, and the distance of the closest decision to its threshold.

    Order as in vLLM: min-p on the full distribution, then top-k, then top-p over what is left
    (renormalized); the token whose mass crosses p is kept. ``top_k >= len(row)``, ``top_p == 1`` and
    ``min_p == 0`` disable their filter.
    """
    m = max(row)
    weights = [math.exp(x - m) for x in row]
    total = sum(weights)
    probs = [w / total for w in weights]
    margin = math.inf
    keep = list(range(len(row)))
    if min_p > 0:
        floor = min_p * max(probs)
        margin = min(abs(p - floor) for p in probs)
        keep = [i for i in keep if probs[i] >= floor]
    keep.sort(key=lambda i: -row[i])
    keep = keep[:top_k]
    if top_p < 1.0:
        mass = sum(weights[i] for i in keep)
        kept, above = [], 0.0
        for i in keep:
            margin = min(margin, abs(above - top_p))
            if above >= top_p:
                break
            kept.append(i)
            above += weights[i] / mass
        keep = kept
    return set(keep), margin


def test_top_k_top_p_min_p_masks_match_the_reference():
    torch.manual_seed(0)
    n, vocab = 48, 40
    logits = torch.randn(n, vocab) * torch.linspace(0.5, 4.0, n)[:, None]  # flat to peaked rows
    gen = torch.Generator().manual_seed(1)
    top_ks = torch.randint(1, vocab + 1, (n,), generator=gen)
    top_ps = torch.rand(n, generator=gen) * 0.95 + 0.04
    min_ps = torch.rand(n, generator=gen) * 0.3
    # Each filter off on some rows, as the runner fills them: k = vocab, p = 1, min_p = 0.
    top_ks[::3] = vocab
    top_ps[1::3] = 1.0
    min_ps[2::3] = 0.0
    min_ps[::4] = 0.0
    out = apply_top_k_top_p_min_p(logits, top_ks, top_ps, min_ps)
    num_masked = num_checked = 0
    for i in range(n):
        row = logits[i].double().tolist()
        kept, margin = ref_kept(row, int(top_ks[i]), float(top_ps[i]), float(min_ps[i]))
        # fp32 softmax and cumsum over 40 tokens err by < 1e-5, so a decision farther than that from its
        # threshold cannot flip and an exact comparison is sound; closer rows are skipped.
        if margin < 1e-5:
            continue
        num_checked += 1
        got = set(torch.nonzero(torch.isfinite(out[i])).flatten().tolist())
        assert got == kept, f"row {i}: k={int(top_ks[i])} p={float(top_ps[i]):.3f} min_p={float(min_ps[i]):.3f}"
        # Kept logits are untouched.
        idx = sorted(kept)
        assert torch.equal(out[i, idx], logits[i, idx])
        num_masked += vocab - len(kept)
    assert num_checked >= 46  # the fixed seed leaves 47 of the 48 rows
    assert num_masked > n * vocab // 4  # the filters did cut a good part of the vocabulary


@pytest.mark.parametrize(
    "top_k, top_p, min_p, kept",
    [
        (2, None, None, {0, 3}),
        (None, 0.5, None, {0}),  # 0.5065 alone reaches 0.5
        (None, 0.51, None, {0, 3}),  # the token that crosses p is kept
        (None, None, 0.5, {0, 3}),  # probs >= 0.5 * 0.5065
        (3, 0.95, None, {0, 3, 1}),
        (3, 0.9, None, {0, 3}),  # top-p renormalizes over the top-k: 0.5065 + 0.3395 = 92.5% of them
        (1, 1.0, 0.0, {0}),
    ],
)
def test_masks_on_a_hand_checked_row(top_k, top_p, min_p, kept):
    # softmax = [0.5065, 0.0685, 0.0252, 0.3395, 0.0603]
    logits = torch.tensor([[2.0, 0.0, -1.0, 1.6, -0.127]])
    probs = logits.softmax(-1)[0]
    assert probs.tolist() == pytest.approx([0.5065, 0.0685, 0.0252, 0.3395, 0.0603], abs=1e-4)
    out = apply_top_k_top_p_min_p(
        logits,
        None if top_k is None else torch.tensor([top_k]),
        None if top_p is None else torch.tensor([top_p]),
        None if min_p is None else torch.tensor([min_p]),
    )
    assert set(torch.nonzero(torch.isfinite(out[0])).flatten().tolist()) == kept


def test_top_p_of_one_keeps_every_token_even_on_a_peaked_row():
    # The runner passes top_p = 1 for rows that do not use it when another row does. A fp32 cumulative
    # sum reaches 1.0 before the tail of a peaked distribution; top_p = 1 must still mask nothing, or a
    # row's distribution would depend on its neighbours in the batch.
    torch.manual_seed(0)
    logits = torch.randn(4, 4096) * 8.0
    out = apply_top_k_top_p_min_p(logits, None, torch.tensor([1.0, 1.0, 0.5, 1.0]), None)
    assert torch.equal(out[[0, 1, 3]], logits[[0, 1, 3]])
    assert torch.isinf(out[2]).sum() > 0


def test_top_k_larger_than_one_and_all_filters_off_change_nothing():
    logits = torch.randn(3, 17)
    assert torch.equal(apply_top_k_top_p_min_p(logits, None, None, None), logits)
    out = apply_top_k_top_p_min_p(logits, torch.tensor([17, 17, 17]), torch.ones(3), torch.zeros(3))
    assert torch.equal(out, logits)


# --------------------------------------------------------------------------------------------------
# penalties
# --------------------------------------------------------------------------------------------------

def ref_penalties(logits: list[list[float]], prompt_ids: list[list[int]], output_ids: list[list[int]],
                  rep: list[float], pres: list[float], freq: list[float]) -> list[list[float]]:
    out = []
    for i, row in enumerate(logits):
        new = []
        for t, x in enumerate(row):
            count = output_ids[i].count(t)
            if t in prompt_ids[i] or count > 0:
                x = x / rep[i] if x > 0 else x * rep[i]
            x -= freq[i] * count + pres[i] * (1.0 if count > 0 else 0.0)
            new.append(x)
        out.append(new)
    return out


def test_penalties_match_the_reference():
    torch.manual_seed(0)
    n, vocab = 4, 12
    logits = torch.randn(n, vocab) * 3
    prompt_ids = [[0, 1, 2], [5], [], [3, 3, 4]]
    output_ids = [[1, 7, 7, 7], [], [2, 9], [4, 11, 4]]
    rep = [1.3, 1.0, 0.7, 2.0]
    pres = [0.5, -0.5, 0.0, 1.5]
    freq = [0.25, 1.0, -0.3, 0.0]
    prompt_mask = torch.zeros(n, vocab, dtype=torch.bool)
    counts = torch.zeros(n, vocab)
    for i in range(n):
        prompt_mask[i, prompt_ids[i]] = True
        for t in output_ids[i]:
            counts[i, t] += 1
    md = make_md(n, repetition=rep, presence=pres, frequency=freq, prompt_mask=prompt_mask,
                 output_counts=counts)
    got = apply_penalties(logits, md)
    want = torch.tensor(ref_penalties(logits.tolist(), prompt_ids, output_ids, rep, pres, freq))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # Tokens in neither prompt nor output are untouched.
    assert got[1, 0].item() == logits[1, 0].item()
    # Repetition divides a positive logit and multiplies a negative one.
    row0 = logits[0].tolist()
    assert got[0, 0].item() == pytest.approx(row0[0] / 1.3 if row0[0] > 0 else row0[0] * 1.3)


def test_repetition_only_needs_no_presence_or_frequency():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    md = make_md(1, repetition=[2.0], prompt_mask=torch.tensor([[True, True, False]]),
                 output_counts=torch.zeros(1, 3))
    assert apply_penalties(logits, md).tolist() == [[1.0, -4.0, 1.0]]


def test_greedy_picks_the_argmax_after_penalties_and_bans():
    logits = torch.tensor([[2.0, 1.9, 0.5, 1.0], [2.0, 1.9, 0.5, 1.0], [2.0, 1.9, 0.5, 1.0]])
    counts = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    banned = torch.tensor([[False] * 4, [False] * 4, [True, True, False, False]])
    md = make_md(3, [0.0, 0.0, 0.0], repetition=[1.5, 1.5, 1.0], prompt_mask=torch.zeros(3, 4, dtype=torch.bool),
                 output_counts=counts, banned=banned)
    # Row 0: 2.0 / 1.5 = 1.33 < 1.9. Row 1: nothing seen. Row 2: tokens 0 and 1 banned (min_tokens).
    assert Sampler()(logits, md).token_ids.tolist() == [1, 0, 3]


def test_greedy_takes_the_first_of_tied_maxima_and_flags_nan_and_posinf_rows():
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [nan, 5.0, 1.0, 0.0], [-inf] * 4, [inf, 2.0, nan, 1.0],
                           [0.0, 0.0, -inf, 0.0], [-1.0, -inf, inf, -2.0]])
    out = Sampler()(logits, make_md(6, [0.0] * 6))
    assert out.token_ids[[0, 2, 4]].tolist() == [1, 0, 0]  # ties: the first index, as argmax
    assert out.nonfinite.tolist() == [False, True, False, True, False, True]  # -inf alone is a legal mask
    assert nonfinite_rows(logits).tolist() == out.nonfinite.tolist()  # the same without the row max
    probs = torch.full((6, 4), 0.25)
    probs[4, 1] = nan
    assert nonfinite_rows(logits, probs).tolist() == [False, True, False, True, True, True]


# --------------------------------------------------------------------------------------------------
# random sampling
# --------------------------------------------------------------------------------------------------

VOCAB = 50
STEPS = 8


def seeded_tokens(batch_rows: int, position: int, seed: int, logits_steps: torch.Tensor,
                  other_seeds: list[int | None]) -> list[int]:
    """Tokens of a row with ``seed`` over STEPS steps, sitting at ``position`` in a batch of other rows."""
    g = torch.Generator().manual_seed(seed)
    others = [None if s is None else torch.Generator().manual_seed(s) for s in other_seeds]
    tokens = []
    for step in range(STEPS):
        rows = torch.randn(batch_rows, VOCAB) * 2.0  # neighbours change every step
        rows[position] = logits_steps[step]
        gens = list(others)
        gens.insert(position, g)
        temps = [0.9 if k % 3 else 0.0 for k in range(batch_rows)]
        temps[position] = 0.9
        top_ps = [0.8] * batch_rows
        top_ps[position] = 1.0
        md = make_md(batch_rows, temps, top_ps=top_ps, generators=gens) if batch_rows > 1 \
            else make_md(1, [0.9], generators=gens)
        tokens.append(int(Sampler()(rows, md).token_ids[position]))
    return tokens


def test_seeded_row_gives_the_same_tokens_alone_or_in_any_batch():
    torch.manual_seed(123)
    logits_steps = torch.randn(STEPS, VOCAB)
    torch.manual_seed(1)
    alone = seeded_tokens(1, 0, 1234, logits_steps, [])
    torch.manual_seed(2)  # the shared generator is in another state
    in_batch = seeded_tokens(5, 2, 1234, logits_steps, [7, None, None, 99])
    torch.manual_seed(3)
    last = seeded_tokens(4, 3, 1234, logits_steps, [None, 1234 + 1, None])
    assert alone == in_batch == last
    # The tokens do come from the seed: another seed gives another sequence.
    assert seeded_tokens(1, 0, 4321, logits_steps, []) != alone
    assert len(set(alone)) > 1


def test_unseeded_rows_use_the_shared_generator():
    logits = torch.zeros(2, VOCAB)  # uniform
    md = make_md(2, [1.0, 1.0])
    torch.manual_seed(5)
    a = Sampler()(logits, md).token_ids.tolist()
    torch.manual_seed(5)
    b = Sampler()(logits, md).token_ids.tolist()
    draws = {tuple(Sampler()(logits, md).token_ids.tolist()) for _ in range(10)}
    assert a == b
    assert len(draws) > 1


def expected_distribution(logits: list[float], temperature: float, top_k: int, top_p: float,
                          min_p: float) -> list[float]:
    scaled = [x / temperature for x in logits]
    kept, _ = ref_kept(scaled, top_k, top_p, min_p)
    m = max(scaled)
    weights = [math.exp(x - m) if i in kept else 0.0 for i, x in enumerate(scaled)]
    return [w / sum(weights) for w in weights]


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(0.8, 5, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (1.7, 5, 1.0, 0.0), (1.0, 3, 1.0, 0.0),
     (1.0, 5, 0.7, 0.0), (1.0, 5, 1.0, 0.3)],
)
@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_frequencies_match_softmax_of_logits_over_temperature(temperature, top_k, top_p, min_p, seeded):
    # 5 tokens, 20,000 independent draws (one row each, so each draw has its own noise).
    logits = [1.0, 0.5, 0.0, -0.5, -2.0]
    n = 20_000
    expected = expected_distribution(logits, temperature, top_k, top_p, min_p)
    torch.manual_seed(2024)
    gens = [torch.Generator().manual_seed(10_000 + i) for i in range(n)] if seeded else None
    md = make_md(n, [temperature] * n,
                 top_ks=[top_k] * n if top_k < 5 else None,
                 top_ps=[top_p] * n if top_p < 1 else None,
                 min_ps=[min_p] * n if min_p > 0 else None,
                 generators=gens)
    tokens = Sampler()(torch.tensor([logits] * n), md).token_ids
    counts = torch.bincount(tokens, minlength=5).tolist()
    assert sum(counts) == n
    for t, (c, p) in enumerate(zip(counts, expected, strict=True)):
        if p == 0.0:
            assert c == 0, f"token {t} is masked but was drawn {c} times"
            continue
        # Each count is Binomial(n, p): allow 5 standard deviations. A correct sampler fails one token
        # with probability < 6e-7; an error of 2% of the mass on a token (400 draws) is > 5 sigma for all
        # of these distributions (sigma <= sqrt(n / 4) = 71).
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(c - n * p) <= 5 * sigma, f"token {t}: {c} draws, expected {n * p:.0f} +- {5 * sigma:.0f}"
    # Chi-square over the kept tokens; with 4 degrees of freedom (nothing masked) its survival function
    # is exp(-x/2) (1 + x/2), and p < 1e-6 would mean the frequencies do not fit.
    if all(p > 0 for p in expected):
        chi2 = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, expected, strict=True))
        assert math.exp(-chi2 / 2) * (1 + chi2 / 2) > 1e-6, f"chi-square {chi2:.1f} with 4 dof"


def test_greedy_rows_ignore_noise_in_a_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    logits[0, 3] = logits[0].max() + 1e-3  # a near tie: noise would flip it
    want = logits.argmax(-1)
    temps = [0.0, 1.0, 0.0, 2.0, 0.0, 1.0]
    results = []
    for seed in range(20):
        torch.manual_seed(seed)
        gens = [torch.Generator().manual_seed(seed * 7 + k) if k % 2 else None for k in range(6)]
        md = make_md(6, temps, top_ks=[VOCAB, 5, VOCAB, VOCAB, 2, VOCAB], generators=gens)
        got = Sampler()(logits, md).token_ids
        assert got[[0, 2, 4]].tolist() == want[[0, 2, 4]].tolist()
        results.append(tuple(got[[1, 3, 5]].tolist()))
    assert len(set(results)) > 1  # the random rows did vary
    # An all-greedy batch takes the argmax without drawing noise.
    md = make_md(6, [0.0] * 6)
    state = torch.get_rng_state()
    assert Sampler()(logits, md).token_ids.tolist() == want.tolist()
    assert torch.equal(torch.get_rng_state(), state)


# --------------------------------------------------------------------------------------------------
# logprobs
# --------------------------------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_with_correct_ranks():
    logits = torch.tensor([[3.0, 2.5, 1.0, 0.0, -1.0],
                           [0.0, 1.0, 2.0, 3.0, 4.0],
                           [1.0, 0.5, 5.0, 0.0, -0.5]])
    # Row 0: repetition penalty on token 0 makes greedy pick token 1 (rank 2 in the raw distribution).
    # Row 1: token 4 banned, greedy picks token 3 (rank 2). Row 2: temperature / top-k do not touch logprobs.
    prompt_mask = torch.zeros(3, 5, dtype=torch.bool)
    prompt_mask[0, 0] = True
    banned = torch.zeros(3, 5, dtype=torch.bool)
    banned[1, 4] = True
    md = make_md(3, [0.0, 0.0, 0.5], top_ks=[5, 5, 1], repetition=[2.0, 1.0, 1.0], prompt_mask=prompt_mask,
                 output_counts=torch.zeros(3, 5), banned=banned, max_num_logprobs=3)
    out = Sampler()(logits, md)
    assert out.token_ids.tolist() == [1, 3, 2]
    raw = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, raw[[0, 1, 2], [1, 3, 2]])
    assert out.ranks.tolist() == [2, 2, 1]
    assert out.top_ids.tolist() == [[0, 1, 2], [4, 3, 2], [2, 0, 1]]
    torch.testing.assert_close(out.top_logprobs, raw.gather(1, out.top_ids))


def test_logprobs_zero_and_none():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    out = Sampler()(logits, make_md(1, [0.0], max_num_logprobs=0))
    assert out.token_ids.tolist() == [1]
    assert out.ranks.tolist() == [1]
    assert out.logprobs.item() == pytest.approx(logits.log_softmax(-1)[0, 1].item())
    assert out.top_ids.shape == (1, 0) and out.top_logprobs.shape == (1, 0)
    out = Sampler()(logits, make_md(1, [0.0], max_num_logprobs=-1))
    assert out.logprobs is None and out.ranks is None and out.top_ids is None and out.top_logprobs is None


def test_token_logprobs_match_float64_for_given_tokens():
    """Prompt logprobs: the log-softmax at given (not sampled) tokens, their ranks and the top-k, against a
    float64 reference on random fp32 logits (no ties). Bound: 1e-5 abs (fp32 log-softmax of values ~N(0, 4))."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 300, generator=g) * 4  # [N, V]
    targets = torch.randint(0, 300, (37,), generator=g)
    targets[0] = logits[0].argmax()  # rank 1
    targets[1] = logits[1].argmin()  # rank V
    out = token_logprobs(logits, targets, 5)
    ref = logits.double().log_softmax(-1)
    want = ref.gather(1, targets[:, None])[:, 0]
    assert out.token_ids is targets
    assert (out.logprobs - want).abs().max().item() < 1e-5
    assert out.ranks.tolist() == ((ref > want[:, None]).sum(-1) + 1).tolist()
    assert out.ranks[0].item() == 1 and out.ranks[1].item() == 300
    top = ref.topk(5, dim=-1)
    assert out.top_ids.tolist() == top.indices.tolist()
    assert (out.top_logprobs - top.values).abs().max().item() < 1e-5
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()  # descending
    empty = token_logprobs(logits.half(), targets, 0)  # any float dtype in; fp32 out
    assert empty.top_ids.shape == (37, 0) and empty.logprobs.dtype == torch.float32
