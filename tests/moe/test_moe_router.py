"""The fused router kernel (``roofline.kernels.moe_router``, Triton under the CPU interpreter) against its torch
twin ``ref_select_experts`` (HF's routing), with exact ties; and the gate GEMV fused with it
(``gate_select_experts``) against the two-launch path, ``F.linear`` in the dtype then ``ref_select_experts``.

Ties: the kernel takes the lowest expert index first. ``torch.topk`` on the CPU does NOT (its order among equal
values comes from ``std::nth_element`` / ``partial_sort``: [0.1, 0.3, 0.2, 0.3, 0.3, 0, 0.3] gives ids
3, 6, 4, 1, 2), so on rows with ties the ids are checked against a stable descending sort of the same
probabilities and the weights (equal values, whichever tied expert carries them) against the torch twin.

Gate inputs are multiples of 2^-5 with |x| <= 2, |w| <= 1/2 and H <= 300: every product is a multiple of 2^-10 and
every partial sum below 2^9, so the fp32 dot product is exact in any summation order (the kernel's, torch's) and
its rounding to the dtype (fp16: logits of a few units lose their low bits) is the same on both paths; the
logits are then bit-identical and so are the ids, exact ties included. fp32 and fp16 only: the interpreter rounds
fp32 -> bf16 toward zero (the GPU to nearest even); bf16 is tests/moe/test_moe_decode_gpu.py's, on a GPU.

Bounds: ids identical (the random logits are far from ties except the exact ones built in); fp32 weights within
2e-6 absolute (the kernel's exp / sum order differs from torch's softmax by a few ulp; weights are in [0, 1]).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from roofline.kernels.moe_router import gate_select_experts, ref_select_experts, select_experts

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


def _gate_inputs(num_tokens, num_experts, hidden, seed, dtype):
    """x [T, H], w [E, H] on the 2^-5 grid (module docstring), with exact logit ties: token 0 all zero (every
    expert ties), experts 1 = 3 and 0 = 5 = E - 1 (the last in another program's tile) where E allows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-64, 65, (num_tokens, hidden), generator=gen).float() / 32
    w = torch.randint(-16, 17, (num_experts, hidden), generator=gen).float() / 32
    if num_tokens > 1:
        x[0] = 0.0
    if num_experts >= 8:
        w[3] = w[1]
        w[5] = w[0]
        w[-1] = w[0]
    return x.to(dtype), w.to(dtype)


def _check_gate_router(num_tokens, num_experts, top_k, renormalize, dtype):
    from roofline.kernels import quant_gemm

    hidden = 96 if num_experts == 60 else 256  # 96: a K tail (BLOCK_K 128); 256: whole tiles
    x, w = _gate_inputs(num_tokens, num_experts, hidden, num_tokens * 1000 + num_experts + top_k, dtype)
    logits = F.linear(x, w)
    assert torch.equal(logits, (x.double() @ w.double().T).to(dtype))  # the grid keeps both sums exact
    ref_w, _ = ref_select_experts(logits, top_k, renormalize)
    ref_ids = _stable_topk_ids(logits, top_k)  # torch.topk's order among ties is not the lowest index first
    for _ in range(2):  # the last program of each token re-arms its counter
        wts, ids = gate_select_experts(x, w, top_k, renormalize)
        assert ids.dtype == torch.int64 and wts.dtype == torch.float32 and ids.shape == (num_tokens, top_k)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(wts, ref_w, rtol=0, atol=WEIGHT_ATOL)
        assert int(quant_gemm._counters(x.device, 1)[:num_tokens].abs().sum()) == 0
    if num_tokens > 1:
        assert ids[0].tolist() == list(range(top_k))  # all experts tie on the zero token


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("num_experts", [8, 60, 128])
@pytest.mark.parametrize("num_tokens", [1, 3, 8])
def test_gate_router_matches_linear_then_router(num_tokens, num_experts, top_k, renormalize):
    """One launch against F.linear in fp32 then the router: the same ids (ties to the lowest index) and weights
    within fp32 rounding, twice in a row."""
    _check_gate_router(num_tokens, num_experts, top_k, renormalize, torch.float32)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("shape", [(1, 128, 8), (3, 60, 2), (8, 8, 1)])
def test_gate_router_rounds_logits_to_fp16_as_the_linear_does(shape, renormalize):
    """fp16: the logits rounded to the dtype before the softmax, as F.linear's output is."""
    _check_gate_router(*shape, renormalize, torch.float16)


def test_gate_router_random_fp32_and_strided_rows():
    """Plain random fp32 (sums rounded in a different order than torch's: the ids still agree, far from ties)
    and an x whose rows are a column slice of a wider tensor."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 200, generator=gen)[:, :160]
    w = torch.randn(16, 160, generator=gen) * 0.1
    ref_w, ref_ids = ref_select_experts(F.linear(x, w), 4, True)
    wts, ids = gate_select_experts(x, w, 4, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(wts, ref_w, rtol=0, atol=WEIGHT_ATOL)


def test_gate_router_errors():
    x, w = torch.zeros(2, 16), torch.zeros(6, 16)
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, num_experts=6\], got 7"):
        gate_select_experts(x, w, 7, True)
    with pytest.raises(ValueError, match=r"x must be \[T, H\] and gate_weight \[E, H\], both with unit stride along "
                                         r"H; got shapes \(2, 16\) and \(6, 8\)"):
        gate_select_experts(x, w[:, :8], 2, True)
    with pytest.raises(ValueError, match=r"got shapes \(16, 2\) and \(6, 2\)"):
        gate_select_experts(x.T, w[:, :2], 2, True)
    with pytest.raises(ValueError, match=r"x and gate_weight must share dtype and device; got torch.float16 on cpu "
                                         r"and torch.float32 on cpu"):
        gate_select_experts(x.half(), w, 2, True)
    wts, ids = gate_select_experts(torch.zeros(0, 16), w, 2, True)
    assert wts.shape == ids.shape == (0, 2)


def test_fused_moe_route_picks_the_fused_gate_where_it_applies(monkeypatch):
    """``FusedMoE.route``: one launch where ``fused_gate_applies`` (kernels on: forced here on the CPU), the gate
    linear then ``select_experts`` elsewhere; both give the same routing."""
    from types import SimpleNamespace

    from roofline.kernels import moe_router
    from roofline.layers import moe
    from roofline.layers.linear import ReplicatedLinear

    layer = moe.FusedMoE(8, 2, 32, 16, prefix="m.experts")
    gate = ReplicatedLinear(32, 8, prefix="m.gate")
    xq, wq = _gate_inputs(3, 8, 32, seed=11, dtype=torch.float32)
    gate.weight.data.copy_(wq)
    assert not moe.fused_gate_applies(xq, gate)  # no CUDA: kernels off for a CPU tensor
    ref = layer.route(xq, gate)
    calls = []
    real = moe_router.gate_select_experts
    monkeypatch.setattr(moe_router, "gate_select_experts", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(moe.dispatch, "kernels_for", lambda t: SimpleNamespace())
    assert moe.fused_gate_applies(xq, gate)
    fused = layer.route(xq, gate)
    assert len(calls) == 1
    # Token 0 (all experts tie): the kernel takes the lowest ids, torch.topk on the CPU its own order.
    assert fused[1][0].tolist() == [0, 1] and torch.equal(fused[1][1:], ref[1][1:])
    torch.testing.assert_close(fused[0], ref[0], rtol=0, atol=WEIGHT_ATOL)
    # Where it does not apply: too many tokens, x in another dtype than the gate, a gate that is not replicated.
    assert not moe.fused_gate_applies(torch.zeros(moe.FUSED_GATE_MAX_TOKENS + 1, 32), gate)
    assert not moe.fused_gate_applies(xq.half(), gate)
    assert not moe.fused_gate_applies(xq, torch.nn.Linear(32, 8, bias=False))
    biased = ReplicatedLinear(32, 8, bias=True, prefix="m.gate")
    assert not moe.fused_gate_applies(xq, biased)
    layer.route(torch.zeros(moe.FUSED_GATE_MAX_TOKENS + 1, 32), gate)
    assert len(calls) == 1
