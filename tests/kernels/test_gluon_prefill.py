"""Gluon sm_90 prefill (roofline.kernels.gluon_prefill) against the float64 oracle, ref_prefill_attention and the
Triton kernel; the fallback rules and the backend switch.

The Gluon kernel only runs on a Hopper GPU (the interpreter cannot run Gluon): those tests are marked ``gpu`` and
skip elsewhere. On the CPU the wrapper must fall back to the Triton kernel (interpreter) with the same result.

Error bounds (bf16 inputs and output, fp32 accumulation): relative Frobenius error against float64 below
TOL[bf16] = 1e-2 and at most 1.5x the Triton kernel's own error on the same case (the two differ only in the
order of fp32 sums and in the bf16 rounding of p); max-abs error against the Triton kernel below 3e-2
(a few bf16 ulps of outputs of size ~1).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import (  # noqa: E402
    TOL,
    attention_f64,
    make_paged_case,
    poison_stale_quantized,
    poison_stale_slots,
    quantize_cache,
    rel_err,
)

from roofline.kernels.gluon_prefill import (  # noqa: E402
    FP8_REL_TOL,
    TREE_VARIANTS,
    choose_prefill_kernel,
    default_gluon_config,
    default_gluon_fp8_config,
    gluon_config_reason,
    gluon_prefill_attention,
    gluon_unsupported_reason,
    ref_prefill_attention_fp8,
)
from roofline.kernels.prefill_attention import (  # noqa: E402
    paged_prefill_attention,
    ref_paged_attention,
    ref_prefill_attention,
)

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
MAX_ABS_VS_TRITON = 3e-2

# (q_lens, seq_lens): full prefills, ragged batches, chunked prefill with a cached prefix (ctx > 0), one-token rows.
SMALL = {
    "full_128": ([128], [128]),
    "ragged": ([1000, 1, 513, 77], [1000, 1, 513, 77]),
    "chunked": ([300, 1, 129, 64], [1000, 515, 129, 4000]),
}
LARGE = {
    "full_4k": ([4096], [4096]),
    "chunked_4k": ([1000, 1, 513, 2048, 77], [1000, 3000, 1024, 2048, 4100]),
    "two_2k": ([2048, 2048], [2048, 6000]),
}


# Round 2 variants (FA3 ping-pong of the two consumer warpgroups; "ws2": the same partitions, no named barriers;
# "persistent": ping-pong on a persistent grid, so several work items run through one CTA's ring and barriers).
NEW_VARIANTS = {"pingpong": dict(VARIANT="pingpong"), "ws2": dict(VARIANT="ws2"),
                "pingpong_n64_s3": dict(VARIANT="pingpong", BLOCK_N=64, NUM_STAGES=3),
                "persistent": dict(VARIANT="persistent")}


def _run_both(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, poison=False, **kw):
    q, kc, vc, meta = make_paged_case(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    if poison:
        poison_stale_slots(kc, vc, meta)
    scale = 1.0 / math.sqrt(head_dim)
    reason = gluon_unsupported_reason(q, kc, vc, config=kw.get("config"))
    assert reason is None, reason  # the case must run the Gluon kernel, not the fallback
    out = torch.full_like(q, float("nan"))  # poison: unwritten rows fail
    gluon_prefill_attention(q, kc, vc, meta, scale, out=out, **kw)
    tri = paged_prefill_attention(q, kc, vc, meta, scale)
    return q, kc, vc, meta, scale, out, tri


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("variant", ["plain", "pipelined", "ws"])
@pytest.mark.parametrize("heads,block_size", [((32, 8), 16), ((32, 8), 64), ((32, 8), 128), ((8, 8), 16)])
@pytest.mark.parametrize("case", list(SMALL))
def test_gluon_matches_float64(case, heads, block_size, variant):
    """bf16, D 128, GQA 32/8 and MHA 8/8, pages of 16/64/128 (a 128-key tile spans 8/2/1 pages), NaN in every
    stale cache slot; the plain kernel (BLOCK_N 128), the pipelined and warp-specialized ones (BLOCK_N 64, 3 stages)."""
    q_lens, seq_lens = SMALL[case]
    config = None if variant == "plain" else dict(VARIANT=variant, BLOCK_N=64, NUM_STAGES=3)
    q, kc, vc, meta, scale, out, tri = _run_both(q_lens, seq_lens, *heads, 128, block_size, torch.bfloat16,
                                                 seed=block_size + heads[0], poison=True, config=config)
    ref64 = attention_f64(q, kc, vc, meta, scale)
    err, err_tri = rel_err(out.cpu(), ref64), rel_err(tri.cpu(), ref64)
    assert err < TOL[torch.bfloat16], f"vs float64: {err:.2e}"
    assert err <= 1.5 * err_tri + 1e-4, f"gluon {err:.2e} vs triton {err_tri:.2e}"
    assert (out.float() - tri.float()).abs().max().item() < MAX_ABS_VS_TRITON


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("config", [None, dict(BLOCK_N=64), dict(NUM_STAGES=3, BLOCK_N=64),
                                    dict(VARIANT="pipelined", BLOCK_N=64, NUM_STAGES=3), dict(VARIANT="pipelined"),
                                    dict(VARIANT="ws", BLOCK_N=64, NUM_STAGES=3), dict(VARIANT="ws", NUM_STAGES=2)])
@pytest.mark.parametrize("head_dim,dtype", [(128, torch.bfloat16), (64, torch.bfloat16), (128, torch.float16)])
def test_gluon_variants(head_dim, dtype, config):
    """Tile variants, head_dim 64 and fp16, chunked with a prefix, pages of 16 (the default block size)."""
    q_lens, seq_lens = SMALL["chunked"]
    q, kc, vc, meta, scale, out, tri = _run_both(q_lens, seq_lens, 32, 8, head_dim, 16, dtype, seed=head_dim,
                                                 poison=True, config=config)
    ref64 = attention_f64(q, kc, vc, meta, scale)
    err, err_tri = rel_err(out.cpu(), ref64), rel_err(tri.cpu(), ref64)
    assert err < TOL[dtype], f"vs float64: {err:.2e}"
    assert err <= 1.5 * err_tri + 1e-4, f"gluon {err:.2e} vs triton {err_tri:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("variant", ["plain", "pipelined", "ws"])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("case", list(LARGE))
def test_gluon_long_sequences(case, block_size, variant):
    """4k-token prefills and chunks over a 6k context (GQA 32/8, D 128, bf16) against the fp32 ref_ on the GPU
    and the Triton kernel (the float64 oracle on the host would take minutes here)."""
    q_lens, seq_lens = LARGE[case]
    config = None if variant == "plain" else dict(VARIANT=variant, BLOCK_N=64, NUM_STAGES=3)
    q, kc, vc, meta, scale, out, tri = _run_both(q_lens, seq_lens, 32, 8, 128, block_size, torch.bfloat16,
                                                 seed=block_size, config=config)
    ref = ref_prefill_attention(q, kc, vc, meta, scale)
    err, err_tri = rel_err(out, ref), rel_err(tri, ref)
    assert err < TOL[torch.bfloat16], f"vs fp32 ref_: {err:.2e}"
    assert err <= 1.5 * err_tri + 1e-4, f"gluon {err:.2e} vs triton {err_tri:.2e}"
    assert (out.float() - tri.float()).abs().max().item() < MAX_ABS_VS_TRITON


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
def test_gluon_q_view_of_fused_qkv():
    """q as a strided view of a fused [T, (H + 2 H_kv) * D] projection, as the model hands it over."""
    q, kc, vc, meta = make_paged_case([700, 33], [900, 33], 32, 8, 128, 16, torch.bfloat16, seed=3)
    fused = torch.randn(q.shape[0], 48 * 128, dtype=q.dtype, device=q.device)
    qv = fused[:, :32 * 128].view(-1, 32, 128)
    qv.copy_(q)
    scale = 1 / math.sqrt(128)
    assert gluon_unsupported_reason(qv, kc, vc) is None
    out = gluon_prefill_attention(qv, kc, vc, meta, scale)
    ref = paged_prefill_attention(q, kc, vc, meta, scale)
    assert (out.float() - ref.float()).abs().max().item() < MAX_ABS_VS_TRITON


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
def test_gluon_falls_back_for_tree_mask_and_head_dim():
    """A tree mask with the plain kernel, or head_dim 96, runs the Triton kernel: the result equals it bit for bit."""
    q, kc, vc, meta = make_paged_case([40, 9], [100, 9], 8, 2, 96, 16, torch.bfloat16, seed=5)
    scale = 1 / math.sqrt(96)
    assert "head_dim 96" in gluon_unsupported_reason(q, kc, vc)
    assert torch.equal(gluon_prefill_attention(q, kc, vc, meta, scale), paged_prefill_attention(q, kc, vc, meta, scale))
    q, kc, vc, meta = make_paged_case([40, 9], [100, 9], 8, 2, 128, 16, torch.bfloat16, seed=6)
    tree = torch.full((2, 8), -1, dtype=torch.int64, device=q.device)
    plain = dict(VARIANT="plain")  # the tree mask is in the warp-specialized kernels only
    assert "tree_mask with VARIANT 'plain'" in gluon_unsupported_reason(q, kc, vc, tree_mask=tree, config=plain)
    assert torch.equal(gluon_prefill_attention(q, kc, vc, meta, scale, tree_mask=tree, config=plain),
                       paged_prefill_attention(q, kc, vc, meta, scale, tree_mask=tree))


def test_gluon_wrapper_falls_back_off_hopper():
    """Off sm_90 (here: the CPU interpreter, fp32) the wrapper is the Triton kernel, with the reason named."""
    if HOPPER:
        pytest.skip("on Hopper the Gluon path runs; covered above")
    dtype = torch.float32
    q, kc, vc, meta = make_paged_case([7, 16], [40, 16], 4, 2, 64, 16, dtype, seed=11)
    reason = gluon_unsupported_reason(q, kc, vc)
    assert reason is not None and ("not CUDA" in reason or "capability" in reason or "gluon" in reason)
    scale = 0.125
    out = gluon_prefill_attention(q, kc, vc, meta, scale)
    assert torch.equal(out, paged_prefill_attention(q, kc, vc, meta, scale))
    assert rel_err(out, ref_prefill_attention(q, kc, vc, meta, scale)) < TOL[dtype]


def test_choose_prefill_kernel(monkeypatch):
    monkeypatch.delenv("ROOFLINE_PREFILL_KERNEL", raising=False)
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
    # "auto" (the default): the Gluon kernel on sm_90 only
    assert choose_prefill_kernel() is (gluon_prefill_attention if hopper else paged_prefill_attention)
    assert choose_prefill_kernel("triton") is paged_prefill_attention
    assert choose_prefill_kernel("gluon") is gluon_prefill_attention
    monkeypatch.setenv("ROOFLINE_PREFILL_KERNEL", "gluon")
    assert choose_prefill_kernel() is gluon_prefill_attention
    monkeypatch.setenv("ROOFLINE_PREFILL_KERNEL", "fa3")
    with pytest.raises(ValueError, match=r"'fa3'.*one of \('auto', 'triton', 'gluon'\)"):
        choose_prefill_kernel()


def test_gluon_config_reason():
    """The host-side config rules (no GPU needed): messages name the value and the allowed range."""
    cfg = default_gluon_config(128, 16)
    assert gluon_config_reason(cfg, 128) is None
    for variant in ("pingpong", "ws2", "persistent"):
        assert gluon_config_reason({**cfg, "VARIANT": variant}, 128) is None
        assert gluon_config_reason({**cfg, "VARIANT": variant}, 128, tree=True) is None
        bad = gluon_config_reason({**cfg, "VARIANT": variant, "BLOCK_M": 64, "num_warps": 4}, 128)
        assert bad is not None and "128 for ('pingpong', 'ws2', 'persistent', 'fp8', 'fp8pp')" in bad
    assert gluon_config_reason({**cfg, "VARIANT": "plain"}, 128, tree=True) == (
        f"tree_mask with VARIANT 'plain': the Gluon tree mask is in {TREE_VARIANTS} only")
    assert "VARIANT one of" in gluon_config_reason({**cfg, "VARIANT": "fa4"}, 128)
    # Q 32 KB + 3 stages of K/V at BLOCK_N 128 (192 KB) fits in 227 KB; 4 stages (256 KB) do not.
    assert gluon_config_reason({**cfg, "VARIANT": "pingpong", "NUM_STAGES": 3}, 128) is None
    big = gluon_config_reason({**cfg, "VARIANT": "pingpong", "NUM_STAGES": 4}, 128)
    assert big is not None and "294912 B of shared memory at head_dim 128, above the 232448 B" in big
    # A tree call runs with BLOCK_N 64: 4 stages fit then (Q 32 KB + 128 KB).
    assert gluon_config_reason({**cfg, "VARIANT": "ws", "NUM_STAGES": 4}, 128, tree=True) is None
    # The FP8 kernel: only for an fp8 cache, and an fp8 cache only with it; no tree mask; 1-byte tiles.
    f8 = default_gluon_fp8_config(128, 16)
    assert gluon_config_reason(f8, 128, fp8=True) is None
    assert gluon_config_reason(cfg, 128, fp8=True) == (
        "VARIANT 'pingpong' with a float8_e4m3fn cache: an fp8 cache runs VARIANT 'fp8' or 'fp8pp', which need one")
    assert gluon_config_reason(f8, 128) == (
        "VARIANT 'fp8' with a 16-bit cache: an fp8 cache runs VARIANT 'fp8' or 'fp8pp', which need one")
    assert "tree_mask with VARIANT 'fp8'" in gluon_config_reason(f8, 128, tree=True, fp8=True)
    pp = {**f8, "VARIANT": "fp8pp"}
    assert gluon_config_reason(pp, 128, fp8=True) is None
    assert gluon_config_reason({**pp, "NUM_VT": 3, "CHUNK": 64, "NUM_STAGES": 2}, 128, fp8=True) is None
    for bad_key in ({"NUM_VT": 4}, {"CHUNK": 8}, {"CHUNK": 128}, {"BLOCK_N": 32}):
        assert "fp8pp" in gluon_config_reason({**pp, **bad_key}, 128, fp8=True) or "BLOCK_N must be" in \
            gluon_config_reason({**pp, **bad_key}, 128, fp8=True)
    # 2 x 16 KB Q + 3 stages (96 KB) + 3 V^T buffers (48 KB) + P (32 KB) = 208 KB fit; 4 stages (240 KB) do not.
    assert gluon_config_reason({**pp, "NUM_VT": 3}, 128, fp8=True) is None
    big = gluon_config_reason({**pp, "NUM_VT": 3, "NUM_STAGES": 4}, 128, fp8=True)
    assert big is not None and "245760 B of shared memory" in big
    # Q 2 x 16 KB + 4 stages of K/V at BLOCK_N 128 (128 KB) + V^T 16 KB + P 32 KB fit; 5 stages (+32 KB) do not.
    assert gluon_config_reason({**f8, "BLOCK_N": 128, "NUM_STAGES": 4}, 128, fp8=True) is None
    big = gluon_config_reason({**f8, "BLOCK_N": 128, "NUM_STAGES": 5}, 128, fp8=True)
    assert big is not None and "245760 B of shared memory at head_dim 128, above the 232448 B" in big


def _random_tree_mask(q_lens, width, seed):
    """[num_seqs, width] int64 ancestor bitmasks: region row j (the last min(q_len, width) rows) gets a random
    parent p < j (or none: a root) and sees itself and p's ancestors; some rows stay -1 (plain causal)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for q_len in q_lens:
        r = min(q_len, width)
        masks = []
        for j in range(r):
            parent = int(torch.randint(-1, j, (1,), generator=g)) if j else -1
            m = (1 << j) | (masks[parent] if parent >= 0 else 0)
            masks.append(m)
        signed = [m - (1 << 64) if m >= 1 << 63 else m for m in masks]
        row = signed + [-1] * (width - r)
        if r > 3:
            row[1] = -1  # a plain causal row inside the region
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("variant", ["ws", "pingpong", "ws2", "persistent"],
                         ids=["ws_tree", "pingpong", "ws2", "persistent"])  # "ws_tree": no substring of "ws2"
@pytest.mark.parametrize("block_size,width", [(16, 64), (128, 37)])
@pytest.mark.parametrize("heads,head_dim", [((32, 8), 128), ((9, 3), 64)], ids=["d128", "smollm2_d64"])
def test_gluon_tree_mask(block_size, width, variant, heads, head_dim):
    """Tree verification in the Gluon kernels (no fallback): random ancestor masks over a cached prefix, trees of
    fewer rows than the width, a region that straddles a 64-key tile, NaN in stale slots; against ref_ with the
    same mask in float64 (on the GPU) and against the Triton kernel with the mask. Both head sizes Gluon runs:
    llama's 32/8 heads of 128 and the default model's (SmolLM2-135M) 9/3 heads of 64."""
    q_lens, seq_lens = [64, 5, 100, 1, 40, 4, 17], [64, 300, 1000, 77, 4000, 130, 45]
    q, kc, vc, meta = make_paged_case(q_lens, seq_lens, *heads, head_dim, block_size, torch.bfloat16, seed=width)
    poison_stale_slots(kc, vc, meta)
    tree = _random_tree_mask(q_lens, width, seed=block_size).to(q.device)
    config = dict(VARIANT=variant)
    scale = 1 / math.sqrt(head_dim)
    assert gluon_unsupported_reason(q, kc, vc, tree_mask=tree, config=config) is None
    out = torch.full_like(q, float("nan"))
    gluon_prefill_attention(q, kc, vc, meta, scale, out=out, config=config, tree_mask=tree)
    tri = paged_prefill_attention(q, kc, vc, meta, scale, tree_mask=tree)
    ref = ref_paged_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
                              compute_dtype=torch.float64, tree_mask=tree)  # float64 on the GPU: fast enough here
    plain = paged_prefill_attention(q, kc, vc, meta, scale)
    assert (tri.float() - plain.float()).abs().max().item() > 0.1  # the mask changes the output
    err, err_tri = rel_err(out.double(), ref.double()), rel_err(tri.double(), ref.double())
    assert err < TOL[torch.bfloat16], f"vs float64 ref_: {err:.2e}"
    assert err <= 1.5 * err_tri + 1e-4, f"gluon {err:.2e} vs triton {err_tri:.2e}"
    assert (out.float() - tri.float()).abs().max().item() < MAX_ABS_VS_TRITON


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("variant", ["pingpong", "ws2", "persistent"])
@pytest.mark.parametrize("heads,block_size", [((32, 8), 16), ((8, 8), 128)])
@pytest.mark.parametrize("case", list(SMALL))
def test_gluon_two_consumer_matches_float64(case, heads, block_size, variant):
    """The two-consumer-partition kernels (ping-pong and ws2; BLOCK_N 128 / 2 stages and 64 / 3): same bounds as
    ``test_gluon_matches_float64``, NaN in every stale slot, rows past each chunk poisoned in out."""
    q_lens, seq_lens = SMALL[case]
    q, kc, vc, meta, scale, out, tri = _run_both(q_lens, seq_lens, *heads, 128, block_size, torch.bfloat16,
                                                 seed=block_size + heads[0], poison=True,
                                                 config=NEW_VARIANTS[variant])
    ref64 = attention_f64(q, kc, vc, meta, scale)
    err, err_tri = rel_err(out.cpu(), ref64), rel_err(tri.cpu(), ref64)
    assert err < TOL[torch.bfloat16], f"vs float64: {err:.2e}"
    assert err <= 1.5 * err_tri + 1e-4, f"gluon {err:.2e} vs triton {err_tri:.2e}"
    assert (out.float() - tri.float()).abs().max().item() < MAX_ABS_VS_TRITON


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("variant", ["pingpong", "pingpong_n64_s3", "persistent"])
@pytest.mark.parametrize("head_dim,dtype", [(64, torch.bfloat16), (128, torch.float16)])
def test_gluon_two_consumer_head_dim_and_fp16(head_dim, dtype, variant):
    q_lens, seq_lens = SMALL["chunked"]
    q, kc, vc, meta, scale, out, tri = _run_both(q_lens, seq_lens, 32, 8, head_dim, 16, dtype, seed=head_dim,
                                                 poison=True, config=NEW_VARIANTS[variant])
    ref64 = attention_f64(q, kc, vc, meta, scale)
    err, err_tri = rel_err(out.cpu(), ref64), rel_err(tri.cpu(), ref64)
    assert err < TOL[dtype], f"vs float64: {err:.2e}"
    assert err <= 1.5 * err_tri + 1e-4, f"gluon {err:.2e} vs triton {err_tri:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("variant", ["pingpong", "ws2", "persistent"])
@pytest.mark.parametrize("case", ["full_4k", "two_2k"])
def test_gluon_two_consumer_long_sequences(case, variant):
    """Many tiles per program (the named-barrier hand-over runs n_tiles + 1 times per warpgroup)."""
    q_lens, seq_lens = LARGE[case]
    q, kc, vc, meta, scale, out, tri = _run_both(q_lens, seq_lens, 32, 8, 128, 16, torch.bfloat16, seed=7,
                                                 config=NEW_VARIANTS[variant])
    ref = ref_prefill_attention(q, kc, vc, meta, scale)
    err, err_tri = rel_err(out, ref), rel_err(tri, ref)
    assert err < TOL[torch.bfloat16], f"vs fp32 ref_: {err:.2e}"
    assert err <= 1.5 * err_tri + 1e-4, f"gluon {err:.2e} vs triton {err_tri:.2e}"
    assert (out.float() - tri.float()).abs().max().item() < MAX_ABS_VS_TRITON



# ------------------------------------------------------------------------------------------------------------
# The FP8 kernel (an fp8_e4m3 cache): E4M3 q (per token and head), K, V (per head) and P (x 448). The oracle is
# float64 attention of the unquantized q over the dequantized cache codes, so the error measured is the kernel's
# own (q and P rounding, fp32 / FP8 accumulation), not the cache format's. Bound: FP8_REL_TOL (relative
# Frobenius), and the Triton kernel on the same codes (q in bf16, p in bf16) must stay below TOL[bf16].

@pytest.fixture(autouse=True)
def _fp8_kernel_default(monkeypatch):
    monkeypatch.delenv("ROOFLINE_GLUON_FP8_PREFILL", raising=False)  # the default: on for an fp8_e4m3 cache


FP8_TWIN_TOL = 1e-2  # the kernel against its torch twin: same rounding points; exp2 and fp32 sum order differ
FP8_CONFIGS = {"n128_s3": dict(VARIANT="fp8"), "n128_s2": dict(VARIANT="fp8", NUM_STAGES=2),
               "n64_s2": dict(VARIANT="fp8", BLOCK_N=64, NUM_STAGES=2), "n64_s3": dict(VARIANT="fp8", BLOCK_N=64),
               "1q_n64_s3": dict(VARIANT="fp8", BLOCK_N=64, Q_SPLIT=False),
               "1q_n128_s2": dict(VARIANT="fp8", NUM_STAGES=2, Q_SPLIT=False),
               # the ping-pong kernel: its default, 2 stages, BLOCK_N 64, one V^T buffer (the ring's phases flip
               # every tile), 3 buffers, and both other transpose chunks
               "pp_n128_s3": dict(VARIANT="fp8pp"), "pp_n128_s2": dict(VARIANT="fp8pp", NUM_STAGES=2),
               "pp_n64_s3": dict(VARIANT="fp8pp", BLOCK_N=64),
               "pp_n128_s2_vt1": dict(VARIANT="fp8pp", NUM_STAGES=2, NUM_VT=1),
               "pp_n128_s3_vt3_c16": dict(VARIANT="fp8pp", NUM_VT=3, CHUNK=16),
               "pp_n64_s2_c64": dict(VARIANT="fp8pp", BLOCK_N=64, NUM_STAGES=2, CHUNK=64)}


def _fp8_case(q_lens, seq_lens, heads, kv_heads, head_dim, block_size, seed, poison=True, dtype=torch.bfloat16):
    q, kc, vc, meta = make_paged_case(q_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype, seed)
    kq, vq, ks, vs = quantize_cache(kc, vc, "fp8_e4m3")
    if poison:
        poison_stale_quantized(kq, vq, meta, ks, vs)
    return q, kq, vq, ks, vs, meta


def _dequant(codes, scale):
    return (codes.double() * scale.double()[:, None]).to(torch.float32)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("case", list(SMALL))
def test_fp8_twin_error_vs_float64(case, block_size):
    """The FP8 kernel's arithmetic (the torch twin: q per-row E4M3 in two terms or one, P as e4m3(P * 448), tiles
    of 64 keys) against float64 over the dequantized codes, on the CPU: within FP8_REL_TOL; q's second term
    lowers the error (the rest is P's rounding)."""
    q_lens, seq_lens = SMALL[case]
    q, kq, vq, ks, vs, meta = _fp8_case(q_lens, seq_lens, 8, 2, 64, block_size, seed=3 + block_size, poison=False,
                                        dtype=torch.float32)
    scale = 1 / math.sqrt(64)
    ref64 = attention_f64(q, _dequant(kq, ks), _dequant(vq, vs), meta, scale)
    # (.cpu(): on a GPU machine the case and the twin are on the GPU, the float64 oracle on the host)
    err = rel_err(ref_prefill_attention_fp8(q, kq, vq, meta, scale, ks, vs).cpu(), ref64)
    err1 = rel_err(ref_prefill_attention_fp8(q, kq, vq, meta, scale, ks, vs, q_split=False).cpu(), ref64)
    print(f"fp8 twin {case} bs{block_size}: two-term q {err:.3e}, one-term q {err1:.3e}")
    assert 1e-3 < err < FP8_REL_TOL and err1 < FP8_REL_TOL  # E4M3 rounding is visible, and bounded
    assert err < 0.85 * err1  # the second term of q is not a no-op


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("config", list(FP8_CONFIGS))
@pytest.mark.parametrize("heads,block_size", [((32, 8), 16), ((32, 8), 64), ((32, 8), 128), ((8, 8), 16)])
@pytest.mark.parametrize("case", list(SMALL))
def test_gluon_fp8_matches_float64(case, heads, block_size, config):
    """fp8_e4m3 cache (NaN codes in every stale slot), D 128, GQA 32/8 and MHA, pages of 16/64/128, BLOCK_N 64
    and 128: within FP8_REL_TOL of float64 over the dequantized codes; the Triton kernel (the fallback) on the
    same codes within TOL[bf16]."""
    q_lens, seq_lens = SMALL[case]
    q, kq, vq, ks, vs, meta = _fp8_case(q_lens, seq_lens, *heads, 128, block_size, seed=block_size + heads[0])
    scale = 1 / math.sqrt(128)
    cfg = FP8_CONFIGS[config]
    assert gluon_unsupported_reason(q, kq, vq, config=cfg) is None
    out = torch.full_like(q, float("nan"))
    gluon_prefill_attention(q, kq, vq, meta, scale, out=out, config=cfg, k_scale=ks, v_scale=vs)
    tri = paged_prefill_attention(q, kq, vq, meta, scale, k_scale=ks, v_scale=vs)
    ref64 = attention_f64(q, _dequant(kq, ks), _dequant(vq, vs), meta, scale)
    twin = ref_prefill_attention_fp8(q, kq, vq, meta, scale, ks, vs, block_n=(cfg or {}).get("BLOCK_N", 128),
                                     q_split=(cfg or {}).get("Q_SPLIT", True))
    err, err_tri, err_twin = rel_err(out.cpu(), ref64), rel_err(tri.cpu(), ref64), rel_err(out, twin)
    print(f"fp8 {case} {heads} bs{block_size} {config}: gluon {err:.3e} triton {err_tri:.3e} vs twin {err_twin:.3e}")
    assert err < FP8_REL_TOL, f"vs float64: {err:.2e}"
    assert err_tri < TOL[torch.bfloat16], f"triton vs float64: {err_tri:.2e}"
    assert err_twin < FP8_TWIN_TOL, f"vs the torch twin of its arithmetic: {err_twin:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("config", ["n64_s3", "n128_s2", "pp_n128_s3", "pp_n128_s2_vt1"])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("case", list(LARGE))
def test_gluon_fp8_long_sequences(case, block_size, config):
    """4k-token prefills and chunks over a 6k context on an fp8 cache, against the Triton kernel on the same
    codes (fp32 accumulation of exact codes; the float64 oracle on the host would take minutes here)."""
    q_lens, seq_lens = LARGE[case]
    q, kq, vq, ks, vs, meta = _fp8_case(q_lens, seq_lens, 32, 8, 128, block_size, seed=block_size, poison=False)
    scale = 1 / math.sqrt(128)
    out = gluon_prefill_attention(q, kq, vq, meta, scale, config=FP8_CONFIGS[config], k_scale=ks, v_scale=vs)
    tri = paged_prefill_attention(q, kq, vq, meta, scale, k_scale=ks, v_scale=vs)
    err = rel_err(out, tri)
    print(f"fp8 long {case} bs{block_size} {config}: gluon vs triton {err:.3e}")
    assert err < FP8_REL_TOL, f"vs the Triton kernel: {err:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
def test_gluon_fp8_falls_back_for_tree_mask_and_int8(monkeypatch):
    """A tree mask on an fp8 cache, an int8 cache, or ROOFLINE_GLUON_FP8_PREFILL=0, runs the Triton kernel: bit
    for bit its result; by default an fp8 cache runs the FP8 kernel (another result)."""
    q, kq, vq, ks, vs, meta = _fp8_case([40, 9], [100, 9], 8, 2, 128, 16, seed=7, poison=False)
    scale = 1 / math.sqrt(128)
    tri = paged_prefill_attention(q, kq, vq, meta, scale, k_scale=ks, v_scale=vs)
    assert not torch.equal(gluon_prefill_attention(q, kq, vq, meta, scale, k_scale=ks, v_scale=vs), tri)
    monkeypatch.setenv("ROOFLINE_GLUON_FP8_PREFILL", "0")
    assert torch.equal(gluon_prefill_attention(q, kq, vq, meta, scale, k_scale=ks, v_scale=vs), tri)
    monkeypatch.delenv("ROOFLINE_GLUON_FP8_PREFILL")
    tree = torch.full((2, 8), -1, dtype=torch.int64, device=q.device)
    assert "tree_mask with VARIANT 'fp8'" in gluon_unsupported_reason(q, kq, vq, tree_mask=tree)
    assert torch.equal(gluon_prefill_attention(q, kq, vq, meta, scale, k_scale=ks, v_scale=vs, tree_mask=tree),
                       paged_prefill_attention(q, kq, vq, meta, scale, k_scale=ks, v_scale=vs, tree_mask=tree))
    q, kc, vc, meta = make_paged_case([40, 9], [100, 9], 8, 2, 128, 16, torch.bfloat16, seed=8)
    kq, vq, ks, vs = quantize_cache(kc, vc, "int8")
    assert torch.equal(gluon_prefill_attention(q, kq, vq, meta, scale, k_scale=ks, v_scale=vs),
                       paged_prefill_attention(q, kq, vq, meta, scale, k_scale=ks, v_scale=vs))
