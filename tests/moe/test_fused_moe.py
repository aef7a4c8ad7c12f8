"""The fused MoE kernel (Triton, under the CPU interpreter in fp32 at small shapes), its ``ref_`` loop, the
router and the ``FusedMoE`` layer's weight formats, each against a float64 loop over experts.

Error bound: fp32 kernels against the float64 loop, max |diff| / max |ref| < 1e-5 (fp32 accumulation over
K <= 96; measured ~3e-7). INT8 experts are compared with the float64 loop over their dequantized weights,
so the bound is the same: only the accumulation order differs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from roofline.kernels import fused_moe_config
from roofline.kernels.fused_moe import (
    fused_moe,
    moe_align_block_size,
    ref_fused_moe,
    ref_fused_moe_dense,
    ref_moe_align_block_size,
)
from roofline.kernels.fused_moe_config import MoeConfig
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


@pytest.mark.parametrize("align", [moe_align_block_size, ref_moe_align_block_size])
def test_align_block_size_sorts_and_pads(align):
    ids = torch.tensor([[2, 0], [2, 1], [-1, 2]])
    sorted_ids, expert_ids, num_post = align(ids, num_experts=4, block_m=4)
    n = ids.numel()
    rows = sorted_ids.view(-1, 4)
    # expert 0: pair 1; expert 1: pair 3; expert 2: pairs 0, 2, 5; each padded to 4 rows. (The Triton kernel
    # places an expert's pairs by atomic adds, so only the set within a run is fixed.)
    assert [sorted(r) for r in rows[:3].tolist()] == [[1, n, n, n], [3, n, n, n], [0, 2, 5, n]]
    assert expert_ids[:3].tolist() == [0, 1, 2] and (expert_ids[3:] == -1).all()
    assert num_post.tolist() == [12]
    assert (sorted_ids[12:] == n).all()  # the pair routed elsewhere (4) is nowhere


@pytest.mark.parametrize("num_experts,block_m,shape", [(8, 16, (37, 2)), (6, 32, (50, 3)), (128, 16, (9, 8))])
def test_align_kernel_matches_ref(num_experts, block_m, shape):
    """The one-program Triton align against the torch ops, on random routings with remote (-1) pairs: the same
    blocks, experts and row count, and the same pairs in each expert's run."""
    gen = torch.Generator().manual_seed(num_experts)
    ids = torch.randint(-1, num_experts, shape, generator=gen)
    got = moe_align_block_size(ids, num_experts, block_m)
    want = ref_moe_align_block_size(ids, num_experts, block_m)
    assert got[0].shape == want[0].shape and got[0].dtype == torch.int32
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert torch.equal(got[0].view(-1, block_m).sort(dim=1).values, want[0].view(-1, block_m).sort(dim=1).values)


# One config of each family the tuner draws from (small shapes: the interpreter runs them in seconds).
CONFIG_FAMILIES = {
    "gemv-n8-k32": MoeConfig(path="gemv", block_n=8, block_k=32, num_stages=1),
    "gemv-n16-k64-uneven": MoeConfig(path="gemv", block_n=16, block_k=64, num_warps=8, num_stages=1),
    # the down kernel with its own tile: 4 rows x 32 of K (80 % 32 == 16: a tail in every slot), 2 warps
    "gemv-down-n4-k32-uneven": MoeConfig(path="gemv", block_n=8, block_k=64, num_stages=1, down_block_n=4,
                                         down_block_k=32, down_num_warps=2),
    "grouped-16x64x128": MoeConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_stages=4),
    "grouped-32x32x32-swizzle": MoeConfig(block_m=32, block_n=32, block_k=32, group_m=4),
    "grouped-128x128x64-g8": MoeConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8),
}


@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("family", list(CONFIG_FAMILIES))
def test_fused_moe_config_families_match_float64_loop(family, quant):
    """Every tile family (GEMV widths with an uneven K tail; grouped tiles from 16 rows to 128x128 with the GROUP_M
    swizzle over more row blocks than one group) against the float64 loop, fp32 and int8 experts."""
    gemv = CONFIG_FAMILIES[family].path == "gemv"  # one program per (pair, rows): few tokens under the interpreter
    x, w13, w2, weights, ids = _case(3 if gemv else 45, 6, 2, 96, 80, seed=3)  # K tails: 96 % 64, 80 % 64 == 16
    scales = (None, None)
    if quant:
        (w13, s13), (w2, s2) = _int8(w13), _int8(w2)
        scales = (s13, s2)
    ref = ref_fused_moe(x, w13, w2, weights, ids, *scales, compute_dtype=torch.float64)
    out = fused_moe(x, w13, w2, weights, ids, *scales, config=CONFIG_FAMILIES[family])
    err = _rel(out, ref)
    print(f"{family} {quant}: rel err {err:.1e}")
    assert err < REL_TOL


@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("slots", [1, 2, 4])
def test_down_kernel_slot_groups_match_float64_loop(slots, quant):
    """The GEMV path's down kernel loading ``down_slots`` experts' tiles at once: top-3 routing, so 2 slots make
    a full and a half-masked group and 4 slots one group with a masked slot; a K tail in every slot (48 % 32);
    pairs routed to another rank (-1) add nothing. Against the float64 loop, fp32 and int8 experts."""
    x, w13, w2, weights, ids = _case(2, 6, 3, 40, 48, seed=7)
    ids[0, 1] = -1  # another rank's expert
    scales = (None, None)
    if quant:
        (w13, s13), (w2, s2) = _int8(w13), _int8(w2)
        scales = (s13, s2)
    ref = ref_fused_moe(x, w13, w2, weights, ids, *scales, compute_dtype=torch.float64)
    cfg = MoeConfig(path="gemv", block_n=8, block_k=32, num_stages=1, down_block_n=4, down_block_k=32,
                    down_num_warps=2, down_slots=slots)
    err = _rel(fused_moe(x, w13, w2, weights, ids, *scales, config=cfg), ref)
    print(f"slots {slots} {quant}: rel err {err:.1e}")
    assert err < REL_TOL


@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("persistent", [1, 3])
def test_persistent_kernels_match_per_item_kernels(persistent, quant):
    """The GEMV path's gate_up and down kernels on a persistent grid (``MoeConfig.persistent`` /
    ``down_persistent`` programs per SM; the CPU counts 4 SMs): a program's items run as one tile stream whose
    prefetch crosses item boundaries. gate_up: 2 tokens x 3 pairs x 6 N tiles of 8 (inter 44: an N tail) = 36
    items, 9 per program at 1 per SM, 3 at 3; down: 2 tokens x 10 N tiles of 4 = 20 items; a K tail in every
    item (40 % 32, 44 % 32) and a remote pair (-1). The same loads and fp32 sums per item as the
    one-program-per-item kernels: bit-identical outputs, and within REL_TOL of the float64 loop (also with 2
    down slots, which sum in another order)."""
    x, w13, w2, weights, ids = _case(2, 6, 3, 40, 44, seed=11)
    ids[1, 2] = -1  # another rank's expert
    scales = (None, None)
    if quant:
        (w13, s13), (w2, s2) = _int8(w13), _int8(w2)
        scales = (s13, s2)
    ref = ref_fused_moe(x, w13, w2, weights, ids, *scales, compute_dtype=torch.float64)
    base = MoeConfig(path="gemv", block_n=8, block_k=32, num_stages=1, down_block_n=4, down_block_k=32,
                     down_num_warps=2)
    per_item = fused_moe(x, w13, w2, weights, ids, *scales, config=base)
    for kw in (dict(persistent=persistent), dict(down_persistent=persistent),
               dict(persistent=persistent, down_persistent=persistent, down_slots=2)):
        out = fused_moe(x, w13, w2, weights, ids, *scales, config=dataclasses.replace(base, **kw))
        err = _rel(out, ref)
        print(f"{kw} {quant}: rel err {err:.1e}")
        assert err < REL_TOL
        if "down_slots" not in kw:  # the slot tiles sum in another order (test_down_kernel_slot_groups_...)
            assert torch.equal(out, per_item), kw


def test_config_table_lookup_and_heuristic(tmp_path):
    """The nearest measured M of the table (vLLM's rule), the loop path outside CUDA-graph capture, and the
    heuristic where the table has no entry; bad configs name the field and the allowed values."""
    key = fused_moe_config.table_key(8, 32, 64, "float32")
    table = {"_source": "test", key: {"1": dict(path="gemv", block_n=4, block_k=32, num_warps=4, num_stages=1),
                                      "64": dict(block_m=32, block_n=32, block_k=32, group_m=2, us=1.0),
                                      "1024": dict(path="loop", us=9.0, fused_config=dict(block_m=64, group_m=8))}}
    path = tmp_path / "table.json"
    path.write_text(__import__("json").dumps(table))
    fused_moe_config.set_config_table(path)
    try:
        fake = type("D", (), {"type": "cuda"})()  # lookup only: the device name is the table's
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.cuda, "get_device_name", lambda d=None: "Test GPU")
            get = fused_moe_config.get_config
            assert get(1, 8, 2, 32, 64, "float32", fake).path == "gemv"
            assert get(40, 8, 2, 32, 64, "float32", fake) == MoeConfig(block_m=32, block_n=32, block_k=32, group_m=2)
            loop = get(900, 8, 2, 32, 64, "float32", fake)
            assert loop.path == "loop" and loop.fused_config == MoeConfig(block_m=64, group_m=8)
        # The loop path runs the expert loop (on the CPU: exactly ref_fused_moe).
        x, w13, w2, weights, ids = _case(6, 8, 2, 64, 32)
        out = fused_moe(x, w13, w2, weights, ids, config=MoeConfig(path="loop"))
        assert torch.equal(out, ref_fused_moe(x, w13, w2, weights, ids))
    finally:
        fused_moe_config.set_config_table(None)
    heur = fused_moe_config.default_config
    # Mixtral at M = 1: gate_up 2 x 14336 / 8 = 3584 programs; down (1 token) 4096 / 4 = 1024 >= 4 per SM.
    assert heur(1, 8, 2, 14336, 4096, True, 132) == MoeConfig(path="gemv", block_n=8, block_k=512, num_stages=1,
                                                               down_block_n=4)
    assert heur(1, 8, 2, 14336, 4096, True, 132).down_tile() == (4, 512, 4)
    assert heur(4, 8, 2, 14336, 4096, True, 132).down_block_n == 16  # 4 tokens x 4096 / 16 = 1024 programs
    assert heur(64, 8, 2, 14336, 4096, False, 132).block_m == 16
    big = heur(2048, 8, 2, 14336, 4096, False, 132)
    assert (big.block_m, big.block_n, big.block_k, big.group_m, big.num_warps) == (128, 128, 64, 8, 8)
    with pytest.raises(ValueError, match=r"MoeConfig.block_n must be a power of two >= 1, got 48"):
        MoeConfig(block_n=48)
    with pytest.raises(ValueError, match=r"MoeConfig.block_m must be >= 16 on the grouped path \(tl.dot\), got 8"):
        MoeConfig(block_m=8)
    with pytest.raises(ValueError, match=r"MoeConfig.down_block_n must be 0 \(as the gate_up tile\) or a power of "
                                         r"two, got 12"):
        MoeConfig(path="gemv", down_block_n=12)
    with pytest.raises(ValueError, match=r"MoeConfig.down_slots must be a power of two >= 1, got 3"):
        MoeConfig(path="gemv", down_slots=3)
    with pytest.raises(ValueError, match=r"MoeConfig.persistent must be in \[0, 64\] programs per SM, got -1"):
        MoeConfig(path="gemv", persistent=-1)
    with pytest.raises(ValueError, match=r"MoeConfig.down_persistent must be in \[0, 64\] programs per SM, got 65"):
        MoeConfig(path="gemv", down_persistent=65)
    with pytest.raises(ValueError, match=r"MoeConfig.path must be grouped, gemv or loop, got 'tiles'"):
        MoeConfig(path="tiles")


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


def test_committed_moe_config_tables_parse():
    """Every committed table (``roofline/kernels/moe_configs/*.json``) loads into valid ``MoeConfig``s keyed by
    shape and M (a field out of range raises, naming it)."""
    tables = sorted(fused_moe_config._TABLES.glob("*.json"))
    for path in tables:
        fused_moe_config.set_config_table(path)
        try:
            entries = fused_moe_config.load_table("any")
        finally:
            fused_moe_config.set_config_table(None)
        assert entries, path
        for key, by_m in entries.items():
            assert key.startswith("E=") and ",dtype=" in key
            assert all(isinstance(m, int) and m >= 1 and isinstance(c, MoeConfig) for m, c in by_m.items())
