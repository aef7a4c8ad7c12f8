"""Exactness of the rejection sampler (roofline.spec_decode.rejection): chi-square goodness of fit of the
emitted tokens against the target distribution.

Threshold: the chi-square statistic over the support of p must stay below its 0.999 quantile (Wilson-Hilferty
approximation, z = 3.090), so a correct sampler fails a given check with probability 0.001. Sample counts are
stated per test (>= 10^5).
"""

from __future__ import annotations

import math

import pytest
import torch

from roofline.spec_decode.rejection import rejection_sample

Z_999 = 3.090  # standard normal 0.999 quantile


def chi2_critical(df: int, z: float = Z_999) -> float:
    """Wilson-Hilferty: chi2_q(df) ~ df (1 - 2/(9 df) + z sqrt(2/(9 df)))^3."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_stat(samples: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of ``samples`` (token ids) against ``p`` [V]; cells with expected count < 5 are
    pooled into one. Tokens outside p's support count as a failure (infinite statistic)."""
    n = samples.numel()
    counts = torch.bincount(samples, minlength=p.numel()).double()
    expected = p.double() * n
    if counts[p == 0].sum() > 0:
        return float("inf"), 1
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big & (p > 0)].sum()[None]])
    exp = torch.cat([expected[big], expected[~big & (p > 0)].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def _run(p: torch.Tensor, q: torch.Tensor | None, k: int, n: int, seed: int, fixed_draft: int | None = None):
    """n rows, each with k drafts: from q (independent per position) or one fixed token (one-hot q)."""
    g = torch.Generator().manual_seed(seed)
    v = p.numel()
    target = p.expand(n, k + 1, v).contiguous()
    if q is None:
        drafts = torch.full((n, k), fixed_draft, dtype=torch.int64)
        draft_probs = None
    else:
        drafts = torch.multinomial(q, n * k, replacement=True, generator=g).view(n, k)
        draft_probs = q.expand(n, k, v).contiguous()
    torch.manual_seed(seed + 1)
    return rejection_sample(target, drafts, torch.full((n,), k, dtype=torch.int64), draft_probs)


CASES = {
    "q close to p": (torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0]), torch.tensor([0.35, 0.35, 0.15, 0.15, 0.0, 0.0])),
    "q puts mass where p has none": (torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0, 0.0]),
                                     torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0, 0.0])),
    "q far from p": (torch.tensor([0.05, 0.05, 0.1, 0.1, 0.3, 0.4]), torch.tensor([0.6, 0.2, 0.1, 0.05, 0.05, 0.0])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_emitted_tokens_follow_the_target(case):
    """200,000 rows, 3 drafts each from q: the first emitted token, and the second where one was emitted,
    are distributed as p (the target is context-free here, so every emitted token is a draw from p)."""
    p, q = CASES[case]
    out = _run(p, q, k=3, n=200_000, seed=0)
    for j in (0, 1):
        has = out.num_emitted > j
        stat, df = chi2_stat(out.token_ids[has, j], p)
        assert stat < chi2_critical(df), f"{case}, emitted token {j}: chi2 {stat:.1f} >= {chi2_critical(df):.1f} (df {df})"
        assert int(has.sum()) >= 100_000 or j == 1


def test_one_hot_draft_follows_the_target():
    """n-gram drafts (one-hot q on token 2, which p gives 0.2): 200,000 rows of 2 drafts; the emitted first
    token is distributed as p, and acceptance is p(x) = 0.2 per test."""
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    out = _run(p, None, k=2, n=200_000, seed=1, fixed_draft=2)
    stat, df = chi2_stat(out.token_ids[:, 0], p)
    assert stat < chi2_critical(df)
    first_accepted = (out.num_accepted >= 1).double().mean().item()
    assert abs(first_accepted - 0.2) < 4 * math.sqrt(0.2 * 0.8 / 200_000)


def test_real_model_next_token_distribution(default_llm):
    """The default model's next-token distribution at temperature 1 (its 64 most likely tokens, renormalized)
    as p, and as q the same model's distribution after a different prompt (a real, mismatched draft):
    100,000 rows of 2 drafts; the first emitted token follows p."""
    tok = default_llm.tokenizer
    ids = tok("The capital of France is", add_special_tokens=True).input_ids
    other = tok("My favourite colour is", add_special_tokens=True).input_ids
    lp = default_llm.score_logprobs(ids)[-1]
    lq = default_llm.score_logprobs(other)[-1]
    top = lp.topk(64).indices
    p = lp[top].exp()
    p = p / p.sum()
    q = lq[top].exp() + 1e-3
    q = q / q.sum()
    out = _run(p.float(), q.float(), k=2, n=100_000, seed=2)
    stat, df = chi2_stat(out.token_ids[:, 0], p)
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} >= {chi2_critical(df):.1f} (df {df})"


def test_greedy_rows_accept_the_argmax_prefix():
    """Greedy: accept while draft == argmax p_j; emit the argmax at the first mismatch, or the bonus argmax."""
    v = 5
    target = torch.zeros(3, 4, v)
    argmax = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [0, 0, 0, 0]])
    target.scatter_(2, argmax[..., None], 1.0)
    drafts = torch.tensor([[1, 2, 0], [1, 2, 3], [4, 4, 4]])
    out = rejection_sample(target, drafts, torch.tensor([3, 3, 0]), None, torch.tensor([True, True, True]))
    assert out.num_accepted.tolist() == [2, 3, 0]
    assert out.token_ids.tolist() == [[1, 2, 3, -1], [1, 2, 3, 4], [0, -1, -1, -1]]
    assert (out.num_emitted == out.num_accepted + 1).all()


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    """A row with its own generator gets the same tokens alone and among other rows."""
    p = torch.tensor([0.25, 0.25, 0.25, 0.25])
    q = torch.tensor([0.7, 0.1, 0.1, 0.1])
    drafts = torch.tensor([[0, 0, 0]])

    def one(batch: int) -> list[int]:
        g = torch.Generator().manual_seed(7)
        gens = [g] + [None] * (batch - 1)
        out = rejection_sample(p.expand(batch, 4, 4).contiguous(), drafts.expand(batch, 3).contiguous(),
                               torch.full((batch,), 3), q.expand(batch, 3, 4).contiguous(), None, gens)
        return out.token_ids[0].tolist()

    assert one(1) == one(5) == one(1)


def test_bad_shapes_are_errors():
    with pytest.raises(ValueError, match="must be"):
        rejection_sample(torch.rand(2, 3, 4), torch.zeros(2, 3, dtype=torch.int64), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"num_draft must be in \[0, 2\]"):
        rejection_sample(torch.rand(2, 3, 4), torch.zeros(2, 2, dtype=torch.int64), torch.tensor([1, 3]))
