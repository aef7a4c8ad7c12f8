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

from kernel_cases import TOL, attention_f64, make_paged_case, poison_stale_slots, rel_err  # noqa: E402

from roofline.kernels.gluon_prefill import (  # noqa: E402
    choose_prefill_kernel,
    gluon_prefill_attention,
    gluon_unsupported_reason,
)
from roofline.kernels.prefill_attention import paged_prefill_attention, ref_prefill_attention  # noqa: E402

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


def _run_both(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, poison=False, **kw):
    q, kc, vc, meta = make_paged_case(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    if poison:
        poison_stale_slots(kc, vc, meta)
    scale = 1.0 / math.sqrt(head_dim)
    reason = gluon_unsupported_reason(q, kc, vc)
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
    """A tree mask or head_dim 96 runs the Triton kernel: the result equals it bit for bit."""
    q, kc, vc, meta = make_paged_case([40, 9], [100, 9], 8, 2, 96, 16, torch.bfloat16, seed=5)
    scale = 1 / math.sqrt(96)
    assert "head_dim 96" in gluon_unsupported_reason(q, kc, vc)
    assert torch.equal(gluon_prefill_attention(q, kc, vc, meta, scale), paged_prefill_attention(q, kc, vc, meta, scale))
    q, kc, vc, meta = make_paged_case([40, 9], [100, 9], 8, 2, 128, 16, torch.bfloat16, seed=6)
    tree = torch.full((2, 8), -1, dtype=torch.int64, device=q.device)
    assert "tree_mask" in gluon_unsupported_reason(q, kc, vc, tree_mask=tree)
    assert torch.equal(gluon_prefill_attention(q, kc, vc, meta, scale, tree_mask=tree),
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
