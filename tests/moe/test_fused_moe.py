"""The fused MoE kernel (Triton, under the CPU interpreter in fp32 at small shapes), its ``ref_`` loop, the
router and the ``FusedMoE`` layer's weight formats, each against a float64 loop over experts.

Error bound: fp32 kernels against the float64 loop, max |diff| / max |ref| < 1e-5 (fp32 accumulation over
K <= 96; measured ~3e-7). INT8 experts are compared with the float64 loop over their dequantized weights,
so the bound is the same: only the accumulation order differs.
"""

from __future__ import annotations

import pytest
import torch

from roofline.kernels.fused_moe import fused_moe, moe_align_block_size, ref_fused_moe, ref_fused_moe_dense
from roofline.layers.moe import FusedMoE, select_experts

REL_TOL = 1e-5


def _case(num_tokens, num_experts, top_k, hidden, inter, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.1
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * 0.1
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=gen), top_k, True)
    return x, w13, w2, weights, ids


def _int8(w):
    s = w.abs().amax(-1) / 127
    return torch.round(w / s[..., None]).to(torch.int8), s


def _rel(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("small_m", [True, False])
@pytest.mark.parametrize("shape", [(1, 8, 2, 64, 32), (3, 8, 2, 32, 48), (37, 6, 3, 48, 96), (70, 4, 1, 32, 32)])
def test_fused_moe_matches_float64_loop(shape, small_m):
    x, w13, w2, weights, ids = _case(*shape)
    ref = ref_fused_moe(x, w13, w2, weights, ids, compute_dtype=torch.float64)
    out = fused_moe(x, w13, w2, weights, ids, small_m=small_m)
    assert out.shape == x.shape and out.dtype == x.dtype
    err = _rel(out, ref)
    print(f"{shape} small_m={small_m}: rel err {err:.1e}")
    assert err < REL_TOL
    # The ref_ twin in fp32 (the CPU path of the model) and its sync-free dense form meet the same bound.
    assert _rel(ref_fused_moe(x, w13, w2, weights, ids), ref) < REL_TOL
    assert _rel(ref_fused_moe_dense(x, w13, w2, weights, ids), ref) < REL_TOL


@pytest.mark.parametrize("small_m", [True, False])
def test_fused_moe_int8_and_remote_experts(small_m):
    """INT8 weights with per-channel scales; pairs routed to another rank's experts (-1) contribute 0."""
    x, w13, w2, weights, ids = _case(9, 8, 2, 64, 32, seed=1)
    q13, s13 = _int8(w13)
    q2, s2 = _int8(w2)
    ids = ids.clone()
    ids[0, 0], ids[4, 1] = -1, -1
    ref = ref_fused_moe(x, q13, q2, weights, ids, s13, s2, compute_dtype=torch.float64)
    deq = ref_fused_moe(x, q13.double() * s13.double()[..., None], q2.double() * s2.double()[..., None], weights, ids,
                        compute_dtype=torch.float64)
    torch.testing.assert_close(ref, deq)
    assert _rel(fused_moe(x, q13, q2, weights, ids, s13, s2, small_m=small_m), ref) < REL_TOL
    assert _rel(ref_fused_moe_dense(x, q13, q2, weights, ids, s13, s2), ref) < REL_TOL
    # Dropping a pair changes the result (the -1 really removed it).
    full = ref_fused_moe(x, q13, q2, weights, ids.abs(), s13, s2, compute_dtype=torch.float64)
    assert (full[0] - ref[0]).abs().max() > 1e-3


def test_align_block_size_sorts_and_pads():
    ids = torch.tensor([[2, 0], [2, 1], [-1, 2]])
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, num_experts=4, block_m=4)
    n = ids.numel()
    rows = sorted_ids.view(-1, 4)
    # expert 0: pair 1; expert 1: pair 3; expert 2: pairs 0, 2, 5 (in pair order); each padded to 4 rows.
    assert rows[:3].tolist() == [[1, n, n, n], [3, n, n, n], [0, 2, 5, n]]
    assert expert_ids[:3].tolist() == [0, 1, 2] and (expert_ids[3:] == -1).all()
    assert num_post.tolist() == [12]
    assert (sorted_ids[12:] == n).all()  # the pair routed elsewhere (4) is nowhere


def test_router_matches_transformers_including_ties():
    """HF's own router modules against ``select_experts``, on logits with exact ties (equal probabilities)."""
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(hidden_size=8, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False)
    hf_router = tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(cfg)
    mix_router = tf.models.mixtral.modeling_mixtral.MixtralTopKRouter(
        tf.MixtralConfig(hidden_size=8, num_local_experts=6, num_experts_per_tok=3))
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 8, generator=gen)
    w[3] = w[1]  # experts 1 and 3 always tie
    w[5] = w[0]
    x = torch.randn(64, 8, generator=gen)
    x[:8] = 0  # all six tie
    with torch.no_grad():
        hf_router.weight.copy_(w)
        mix_router.weight.copy_(w)
        logits = x @ w.T
        for router, renorm in ((hf_router, False), (mix_router, True)):
            _, hf_w, hf_ids = router(x)
            ours_w, ours_ids = select_experts(logits, 3, renorm)
            assert torch.equal(ours_ids, hf_ids)
            torch.testing.assert_close(ours_w, hf_w.float(), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, num_experts=6\], got 7"):
        select_experts(logits, 7, True)


@pytest.mark.parametrize("quantization", [None, "int8", "fp8"])
def test_fused_moe_layer_formats(quantization):
    """The layer through its weight format (16-bit, int8, fp8 weight-only): loading per-expert tensors, the
    quantization at load, and forward against the float64 loop over the weights it holds."""
    from roofline.quant.registry import get_quantization_config

    num_experts, top_k, hidden, inter = 4, 2, 32, 16
    qc = get_quantization_config(quantization).from_config() if quantization else None
    layer = FusedMoE(num_experts, top_k, hidden, inter, quant_config=qc, prefix="m.experts")
    gen = torch.Generator().manual_seed(2)
    dense = {}
    for e in range(num_experts):
        for j, shape in ((0, (inter, hidden)), (1, (inter, hidden)), (2, (hidden, inter))):
            t = torch.randn(*shape, generator=gen) * 0.1
            dense[e, j] = t
            layer.weight_loader(layer.w2_weight if j == 2 else layer.w13_weight, t, (e, j))
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(5, hidden, generator=gen)
    logits = torch.randn(5, num_experts, generator=gen)
    w, ids = select_experts(logits, top_k, True)
    w13 = torch.stack([torch.cat([dense[e, 0], dense[e, 1]]) for e in range(num_experts)]).double()
    w2 = torch.stack([dense[e, 2] for e in range(num_experts)]).double()
    exact = ref_fused_moe(x, w13, w2, w, ids, compute_dtype=torch.float64)
    out = layer(x, logits)
    if quantization is None:
        assert layer.w13_weight.dtype == torch.float32
        assert _rel(out, exact) < REL_TOL
    else:
        held = ref_fused_moe(x, layer.w13_weight, layer.w2_weight, w, ids, layer.w13_weight_scale,
                             layer.w2_weight_scale, compute_dtype=torch.float64)
        assert layer.w13_weight.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[quantization]
        assert _rel(out, held) < REL_TOL
        # and the quantization error itself is that of 8 bits (int8 ~0.4 %, e4m3 ~3 % per weight)
        assert _rel(out, exact) < {"int8": 0.02, "fp8": 0.1}[quantization]
        assert layer.quant_method.expert_bytes(layer) == 3 * hidden * inter + 4 * (2 * inter + hidden)


def test_format_without_expert_kernel_is_named():
    from roofline.quant.registry import get_quantization_config

    with pytest.raises(ValueError, match=r"m\.experts: quantization 'int4' has no expert \(MoE\) kernel; formats with "
                                         r"one: int8, fp8"):
        FusedMoE(4, 2, 32, 16, quant_config=get_quantization_config("int4").from_config(), prefix="m.experts")
