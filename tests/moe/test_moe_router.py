"""The fused router kernel (``roofline.kernels.moe_router``, Triton under the CPU interpreter) against its torch
twin ``ref_select_experts`` (HF's routing), with exact ties.

Ties: the kernel takes the lowest expert index first. ``torch.topk`` on the CPU does NOT (its order among equal
values comes from ``std::nth_element`` / ``partial_sort``: [0.1, 0.3, 0.2, 0.3, 0.3, 0, 0.3] gives ids
3, 6, 4, 1, 2), so on rows with ties the ids are checked against a stable descending sort of the same
probabilities and the weights (equal values, whichever tied expert carries them) against the torch twin.

Bounds: ids identical (the random logits are far from ties except the exact ones built in); fp32 weights within
2e-6 absolute (the kernel's exp / sum order differs from torch's softmax by a few ulp; weights are in [0, 1]).
"""

from __future__ import annotations

import pytest
import torch

from roofline.kernels.moe_router import ref_select_experts, select_experts

WEIGHT_ATOL = 2e-6


def _logits(num_tokens, num_experts, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 2
    if num_tokens > 2:
        logits[0] = 0.0  # every expert ties
        logits[1, ::2] = logits[1, 1]  # half the experts tie at one value, inside the top-k or at its edge
        logits[2] = torch.arange(num_experts).remainder(3).float()  # three-way tie blocks, ids interleaved
    return logits.to(dtype)


def _stable_topk_ids(logits, top_k):
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]


def test_ties_go_to_the_lowest_index():
    """The kernel's rule on a row of four equal maxima (torch.topk on the CPU gives 3, 6, 4, 1, 2 here)."""
    logits = torch.tensor([[0.1, 0.3, 0.2, 0.3, 0.3, 0.0, 0.3]]).log()
    w, ids = select_experts(logits, 5, False)
    assert ids.tolist() == [[1, 3, 4, 6, 2]]
    torch.testing.assert_close(w, torch.tensor([[0.3, 0.3, 0.3, 0.3, 0.2]]) / 1.5, rtol=0, atol=WEIGHT_ATOL)
    w, ids = select_experts(torch.zeros(2, 9), 4, False)
    assert ids.tolist() == [[0, 1, 2, 3]] * 2
    torch.testing.assert_close(w, torch.full((2, 4), 1 / 9), rtol=0, atol=WEIGHT_ATOL)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("shape", [(1, 128, 8), (5, 8, 2), (7, 60, 4), (3, 6, 6), (4, 3, 1), (2, 1, 1), (33, 16, 1)])
def test_fused_router_matches_ref(shape, renormalize):
    num_tokens, num_experts, top_k = shape
    logits = _logits(num_tokens, num_experts, seed=num_tokens * 1000 + num_experts)
    ref_w, ref_ids = ref_select_experts(logits, top_k, renormalize)
    w, ids = select_experts(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (num_tokens, top_k)
    assert torch.equal(ids, _stable_topk_ids(logits, top_k))
    tied = 3 if num_tokens > 2 else 0  # rows 0-2 hold the exact ties; elsewhere torch.topk's ids agree
    assert torch.equal(ids[tied:], ref_ids[tied:])
    torch.testing.assert_close(w, ref_w, rtol=0, atol=WEIGHT_ATOL)
    if renormalize:
        torch.testing.assert_close(w.sum(-1), torch.ones(num_tokens), rtol=0, atol=WEIGHT_ATOL)


def test_fused_router_bf16_logits_and_strided_rows():
    """bf16 logits (the gate's output dtype on a GPU) and a row stride wider than E (a column slice)."""
    wide = _logits(6, 80, seed=3, dtype=torch.bfloat16)
    logits = wide[:, :64]
    ref_w, ref_ids = ref_select_experts(logits, 8, True)
    w, ids = select_experts(logits, 8, True)
    assert torch.equal(ids, _stable_topk_ids(logits, 8)) and torch.equal(ids[3:], ref_ids[3:])
    torch.testing.assert_close(w, ref_w, rtol=0, atol=WEIGHT_ATOL)


def test_fused_router_errors():
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, num_experts=6\], got 7"):
        select_experts(torch.zeros(2, 6), 7, True)
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, num_experts=6\], got 0"):
        ref_select_experts(torch.zeros(2, 6), 0, True)
    with pytest.raises(ValueError, match=r"router_logits must be \[T, E\] with unit stride along E, got shape \(6, 2\)"):
        select_experts(torch.zeros(2, 6).T, 1, True)
    w, ids = select_experts(torch.zeros(0, 6), 2, True)
    assert w.shape == ids.shape == (0, 2)
