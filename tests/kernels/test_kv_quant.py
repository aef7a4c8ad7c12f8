"""Quantized KV caches (int8, fp8 e4m3) through the Triton store, decode and prefill kernels.

Two bounds, two questions (kernel_cases.py states them):
- kernel vs its ref_ twin on the SAME quantized cache: TOL[dtype], as for 16/32-bit caches (the kernels'
  own error: dequantization in registers, scales after the QK dot and on p before the PV dot);
- the quantized ref vs the float64 oracle on the UNQUANTIZED cache: QUANT_TOL[format] (the format's error).
Stale slots (slots no sequence owns) are poisoned: NaN int8 scales with the largest codes, NaN fp8 codes.

The Triton interpreter decodes float8e4nv correctly (except the NaN code, which it reads as +-480, still a
poison that shows) but its fp32 -> float8e4nv conversion drops the carry when rounding crosses a binade
(31.7 -> 16 instead of 32) and mis-rounds subnormals (triton/runtime/interpreter.py ``_convert_float``,
triton 3.9): the fp8 STORE kernel is therefore checked on the GPU only; on CPU fp8 stores go through the
ref twin (test_fp8_ref_round_trip and the torch backend), and the fp8 attention kernels run here on caches
the ref twin wrote.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import (  # noqa: E402
    DEVICE,
    KV_FORMATS,
    QUANT_TOL,
    TOL,
    attention_f64,
    gpu_only,
    make_paged_case,
    poison_stale_quantized,
    quantize_cache,
    rel_err,
)

from roofline.kernels.common import (  # noqa: E402
    FP8_E4M3_MAX,
    kv_quant_mode,
    ref_dequantize,
    ref_quantize_fp8,
    ref_quantize_int8,
)
from roofline.kernels.decode_attention import paged_decode_attention, ref_decode_attention  # noqa: E402
from roofline.kernels.prefill_attention import paged_prefill_attention, ref_prefill_attention  # noqa: E402
from roofline.kernels.rope_cache import ref_rope_and_cache, rope_and_cache, store_kv_cache  # noqa: E402

ON_GPU = torch.cuda.is_available()
QDTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=gpu_only, id="bfloat16")]
PREFILL_CASES = {"chunked_extend": ([7, 16, 1, 20], [40, 16, 19, 52]), "ragged_prefill": ([5, 17, 1, 33], [5, 17, 1, 33])}


def _cos_sin(max_pos: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((ang.cos(), ang.sin()), dim=-1).float().to(DEVICE)


def _store_case(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks = (num_tokens + block_size - 1) // block_size + 2
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g)
    # Per-head magnitudes from 0.01 to 10: scales must follow each head.
    mag = torch.logspace(-2, 1, num_kv_heads)[None, :, None]
    k = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=g) * mag).to(dtype)
    v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=g) * mag).to(dtype)
    k[0, 0] = 0.0  # an all-zero row: int8 scale 0, codes 0, dequantized exactly
    positions = torch.randint(0, 2048, (num_tokens,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [t.to(DEVICE) for t in (q.to(dtype), k, v, positions, slots)] + [shape]


# ---------------------------------------------------------------------------------------------- the store

def _poisoned_int8_cache(shape):
    """(k codes, v codes, k scales, v scales) of an int8 cache of ``shape`` [blocks, block, H_kv, D]: codes 77 and
    scales NaN, so a slot the store should not write shows it kept its poison."""
    kc = torch.full(shape, 77, dtype=torch.int8, device=DEVICE)
    ks = torch.full(shape[:3], float("nan"), device=DEVICE)
    return kc, kc.clone(), ks, ks.clone()


def _flat_slots(t):
    """A cache [blocks, block, ...] as [slots, ...]."""
    return t.view(-1, *t.shape[2:])


def _assert_int8_codes_of(k, v, kc, vc, ks, vs, slots):
    """The cache's codes and scales at the written slots (``slots`` >= 0) equal, bit for bit, the ref quantizer's
    of ``k`` and ``v`` as the kernel left them (so a rotation or norm that rounds differently by an ulp does not
    count against the quantization)."""
    ref_kq, ref_ks = ref_quantize_int8(k)
    ref_vq, ref_vs = ref_quantize_int8(v)
    valid = slots >= 0
    flat = _flat_slots
    assert torch.equal(flat(kc)[slots[valid]], ref_kq[valid]) and torch.equal(flat(vc)[slots[valid]], ref_vq[valid])
    assert torch.equal(flat(ks)[slots[valid]], ref_ks[valid]) and torch.equal(flat(vs)[slots[valid]], ref_vs[valid])



@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim,block_size",
                         [(19, 9, 3, 64, 1), (40, 8, 2, 128, 32), (5, 6, 2, 96, 16)])
def test_int8_store_matches_ref_and_round_trips(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype):
    q, k, v, pos, slots, shape = _store_case(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, 5)
    slots[1] = -1  # padding: nothing written
    cs = _cos_sin(2048, head_dim)
    kc, vc, ks, vs = _poisoned_int8_cache(shape)
    rq, rk, rkc, rvc, rks, rvs = q.clone(), k.clone(), kc.clone(), vc.clone(), ks.clone(), vs.clone()
    rope_and_cache(q, k, v, pos, cs, kc, vc, slots, ks, vs)
    ref_rope_and_cache(rq, rk, v, pos, cs, rkc, rvc, slots, rks, rvs)
    assert rel_err(k, rk) < TOL[dtype] and rel_err(q, rq) < TOL[dtype]
    # Same codes and scales as the ref twin, bit for bit (IEEE division in both), from the same rotated k.
    # fp16/bf16: the rotation itself may round differently by one ulp (FMA), so compare codes from the
    # kernel's own k: re-quantize it with the ref and require equality.
    valid = slots >= 0
    flat = _flat_slots
    _assert_int8_codes_of(k, v, kc, vc, ks, vs, slots)
    if dtype == torch.float32 and not ON_GPU:  # same rotation (no FMA contraction in the interpreter): whole caches agree
        assert torch.equal(kc, rkc) and torch.equal(vc, rvc)
        assert torch.equal(ks.nan_to_num(-1.0), rks.nan_to_num(-1.0))
    # Scale values: amax / 127 per (token, head), against float64.
    want_ks = k.double().abs().amax(-1) / 127.0
    assert torch.allclose(flat(ks)[slots[valid]].double(), want_ks[valid], rtol=1e-6, atol=0)
    assert float(flat(ks)[slots[0]][0]) == 0.0 and (flat(kc)[slots[0]][0] == 0).all()
    # Round trip: |x - code * scale| <= scale / 2 (plus fp32 rounding of the product), codes in [-127, 127].
    for codes, scales, x in ((kc, ks, k), (vc, vs, v)):
        c, s = flat(codes)[slots[valid]], flat(scales)[slots[valid]]
        deq = ref_dequantize(c, s, torch.float64)
        err = (deq - x[valid].double()).abs()
        assert (err <= s.double()[..., None] * (0.5 + 1e-5)).all()
        assert int(c.min()) >= -127 and int(c.max()) <= 127
    # Untouched slots keep their poison.
    untouched = torch.ones(flat(kc).shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[valid]] = False
    assert (flat(kc)[untouched] == 77).all() and torch.isnan(flat(ks)[untouched]).all()


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim,block_size", [(19, 9, 3, 64, 1), (7, 8, 2, 128, 32)])
def test_int8_store_with_qk_norm(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """Qwen3's q/k RMSNorm fused before the rotation (``rope_and_cache(q_norm_weight=...)``) into an int8 cache:
    q and k against the ref twin (TOL), the codes and scales bit for bit those of the kernel's own normed, rotated
    k (the norm's mean square may sum in another order than torch's), padding (slot -1) not written."""
    q, k, v, pos, slots, shape = _store_case(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, 11)
    slots[1] = -1
    g = torch.Generator().manual_seed(12)
    wq, wk = ((1 + 0.2 * torch.randn(head_dim, generator=g)).to(dtype).to(DEVICE) for _ in range(2))
    cs = _cos_sin(2048, head_dim)
    kc, vc, ks, vs = _poisoned_int8_cache(shape)
    rq, rk, rkc, rvc, rks, rvs = q.clone(), k.clone(), kc.clone(), vc.clone(), ks.clone(), vs.clone()
    norm = dict(q_norm_weight=wq, k_norm_weight=wk, norm_eps=1e-6)
    rope_and_cache(q, k, v, pos, cs, kc, vc, slots, ks, vs, **norm)
    ref_rope_and_cache(rq, rk, v, pos, cs, rkc, rvc, slots, rks, rvs, **norm)
    assert rel_err(k, rk) < TOL[dtype] and rel_err(q, rq) < TOL[dtype]
    assert (k[0, 0] == 0).all()  # the all-zero row stays 0 through the norm
    valid = slots >= 0
    flat = _flat_slots
    _assert_int8_codes_of(k, v, kc, vc, ks, vs, slots)
    untouched = torch.ones(flat(kc).shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[valid]] = False
    assert (flat(kc)[untouched] == 77).all() and torch.isnan(flat(ks)[untouched]).all()


def test_fp8_ref_round_trip_and_saturation():
    g = torch.Generator().manual_seed(3)
    mag = torch.tensor([0.05, 1.0, 30.0])[None, :, None]
    x = torch.randn(64, 3, 64, generator=g) * mag  # [T, H_kv, D]
    scale = x.abs().amax(dim=(0, 2)) * 2.0 / FP8_E4M3_MAX  # the calibration rule, headroom 2
    codes = ref_quantize_fp8(x, scale)
    assert codes.dtype == torch.float8_e4m3fn
    deq = ref_dequantize(codes, scale, torch.float64)
    y = x.double() / scale.double()[:, None]  # in code units
    normal = y.abs() >= 2.0 ** -6
    # E4M3: 3 mantissa bits -> relative error <= 2^-4 in the normal range; absolute <= 2^-10 (half the
    # subnormal step 2^-9) below it, in code units.
    rel = ((deq - x.double()) / x.double()).abs()
    assert (rel[normal] <= 2.0 ** -4).all()
    assert ((deq - x.double()).abs()[~normal] <= 2.0 ** -10 * scale.double()[:, None].expand_as(x)[~normal]).all()
    assert float(rel[normal].mean()) < 2.0 ** -5  # and typically half that
    # Values past +-448 x scale saturate (never inf/NaN).
    big = torch.tensor([[[1e9, -1e9, 500.0, 447.0]]]) * torch.ones(1, 1, 1)
    sat = ref_dequantize(ref_quantize_fp8(big, torch.ones(1)), torch.ones(1))
    assert sat.tolist() == [[[448.0, -448.0, 448.0, 448.0]]]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the interpreter's fp32->fp8 conversion is wrong)")
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk_norm+rope"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_store_kernel_matches_ref(dtype, qk_norm):
    q, k, v, pos, slots, shape = _store_case(300, 32, 8, 128, 16, dtype, 9)
    cs = _cos_sin(2048, 128)
    kc = torch.full(shape, float("nan"), device=DEVICE).to(torch.float8_e4m3fn)
    vc = kc.clone()
    ks = torch.logspace(-3, 0, 8, device=DEVICE)
    vs = torch.logspace(-2, 0, 8, device=DEVICE)
    rq, rk = q.clone(), k.clone()
    g = torch.Generator().manual_seed(10)
    norm = dict(q_norm_weight=(1 + 0.2 * torch.randn(128, generator=g)).to(dtype).to(DEVICE),
                k_norm_weight=(1 + 0.2 * torch.randn(128, generator=g)).to(dtype).to(DEVICE),
                norm_eps=1e-6) if qk_norm else {}
    rope_and_cache(q, k, v, pos, cs, kc, vc, slots, ks, vs, **norm)
    ref_rope_and_cache(rq, rk, v, pos, cs, kc.clone(), vc.clone(), slots, ks, vs, **norm)
    assert rel_err(k, rk) < TOL[dtype] and rel_err(q, rq) < TOL[dtype]
    flat = lambda t: t.view(-1, *t.shape[2:])  # noqa: E731
    # From the kernel's own rotated k (the rotation may differ by one ulp in 16-bit), codes bit for bit.
    assert torch.equal(flat(kc)[slots].view(torch.uint8), ref_quantize_fp8(k, ks).view(torch.uint8))
    assert torch.equal(flat(vc)[slots].view(torch.uint8), ref_quantize_fp8(v, vs).view(torch.uint8))
    untouched = torch.ones(flat(kc).shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.isnan(flat(kc)[untouched].float()).all()


def test_store_only_int8_and_bad_scales():
    _, k, v, _, slots, shape = _store_case(6, 2, 2, 32, 16, torch.float32, 1)
    kc = torch.zeros(shape, dtype=torch.int8, device=DEVICE)
    vc = kc.clone()
    ks = torch.zeros(shape[:3], device=DEVICE)
    vs = ks.clone()
    store_kv_cache(k, v, kc, vc, slots, ks, vs)
    codes, scale = ref_quantize_int8(k)
    assert torch.equal(kc.view(-1, 2, 32)[slots], codes) and torch.equal(ks.view(-1, 2)[slots], scale)
    with pytest.raises(ValueError, match=r"needs k_scale float32 contiguous \(3, 16, 2\), got None"):
        store_kv_cache(k, v, kc, vc, slots)
    with pytest.raises(ValueError, match=r"needs v_scale float32 contiguous \(2,\), got \(3, 16, 2\)"):
        kv_quant_mode(kc.to(torch.float8_e4m3fn), torch.ones(2, device=DEVICE), vs)
    with pytest.raises(ValueError, match="takes no scales"):
        kv_quant_mode(kc.float(), ks, vs)
    with pytest.raises(ValueError, match=r"unsupported KV cache dtype torch.uint8"):
        kv_quant_mode(kc.view(torch.uint8), ks, vs)


# ---------------------------------------------------------------------------------------------- attention

def _quantized_case(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, fmt, seed):
    q, kc, vc, meta = make_paged_case(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    kq, vq, ks, vs = quantize_cache(kc, vc, fmt)
    poison_stale_quantized(kq, vq, meta, ks, vs)
    return q, kc, vc, kq, vq, ks, vs, meta


def _check_decode(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, fmt, seed, **kw):
    q, kc, vc, kq, vq, ks, vs, meta = _quantized_case([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads,
                                                      head_dim, block_size, dtype, fmt, seed)
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, kq, vq, meta.block_tables, meta.seq_lens, scale, out=out, k_scale=ks, v_scale=vs, **kw)
    ref = ref_decode_attention(q, kq, vq, meta.block_tables, meta.seq_lens, scale, k_scale=ks, v_scale=vs)
    err_ref = rel_err(out, ref)
    err_quant = rel_err(ref.cpu(), attention_f64(q, kc, vc, meta, scale))
    assert err_ref < TOL[dtype], f"kernel vs ref on the same {fmt} cache: {err_ref:.2e} >= {TOL[dtype]}"
    assert err_quant < QUANT_TOL[fmt], f"{fmt} ref vs float64: {err_quant:.2e} >= {QUANT_TOL[fmt]}"


def _check_prefill(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, fmt, seed, config=None):
    q, kc, vc, kq, vq, ks, vs, meta = _quantized_case(q_lens, seq_lens, num_heads, num_kv_heads, head_dim,
                                                      block_size, dtype, fmt, seed)
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, kq, vq, meta, scale, out=out, config=config, k_scale=ks, v_scale=vs)
    ref = ref_prefill_attention(q, kq, vq, meta, scale, k_scale=ks, v_scale=vs)
    err_ref = rel_err(out, ref)
    err_quant = rel_err(ref.cpu(), attention_f64(q, kc, vc, meta, scale))
    assert err_ref < TOL[dtype], f"kernel vs ref on the same {fmt} cache: {err_ref:.2e} >= {TOL[dtype]}"
    assert err_quant < QUANT_TOL[fmt], f"{fmt} ref vs float64: {err_quant:.2e} >= {QUANT_TOL[fmt]}"


@pytest.mark.parametrize("fmt", KV_FORMATS)
@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("block_size,group,num_splits", [(16, 1, 3), (1, 3, 1), (32, 4, 8)])
def test_decode_quantized_matches_references(fmt, dtype, block_size, group, num_splits):
    _check_decode([1, 16, 33, 100], 2 * group, 2, 64, block_size, dtype, fmt, seed=block_size + num_splits,
                  num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("fmt", KV_FORMATS)
@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("case", list(PREFILL_CASES))
@pytest.mark.parametrize("block_size,group", [(16, 1), (1, 3)])
def test_prefill_quantized_matches_references(fmt, dtype, case, block_size, group):
    q_lens, seq_lens = PREFILL_CASES[case]
    _check_prefill(q_lens, seq_lens, 2 * group, 2, 64, block_size, dtype, fmt, seed=block_size + 10 * group)


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_quantized_head_dim_not_power_of_two(fmt):
    _check_decode([5, 70], 4, 2, 96, 16, torch.float32, fmt, seed=96, num_splits=2, block_n=16)
    _check_prefill([9, 3], [9, 21], 4, 2, 96, 16, torch.float32, fmt, seed=96)


# ---------------------------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", KV_FORMATS)
@pytest.mark.parametrize("head_dim,block_size,group", [(128, 16, 4), (128, 64, 4), (64, 32, 1), (256, 16, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_quantized_gpu_large(fmt, head_dim, block_size, group, dtype):
    # GPU tiles (BLOCK_N 64), default num_splits, contexts up to 9k, bf16/fp16 q on int8/fp8 codes.
    _check_decode([1, 4097, 9000, 300, 2048], 8 * group, 8, head_dim, block_size, dtype, fmt,
                  seed=head_dim + block_size)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", KV_FORMATS)
@pytest.mark.parametrize("head_dim,block_size,group", [(128, 16, 4), (128, 64, 4), (64, 32, 1), (256, 16, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_quantized_gpu_large(fmt, head_dim, block_size, group, dtype):
    # Default GPU tile configs: block_size 64 with D 128 takes the TMA path (int8/e4m3 tensor descriptors).
    _check_prefill([1000, 1, 513, 2048, 77], [1000, 3000, 1024, 2048, 4100], 8 * group, 8, head_dim, block_size,
                   dtype, fmt, seed=head_dim + block_size)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", KV_FORMATS)
@pytest.mark.parametrize("config", [dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2, USE_TMA=True),
                                    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, USE_TMA=True),
                                    # 4-warp warp specialization does not compile in triton 3.6 (PassManager)
                                    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, WARP_SPEC=True),
                                    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)],
                         ids=["tma-128x64", "tma-128x128", "warp-spec", "pointer-64x64"])
def test_prefill_quantized_gpu_configs_ignore_stale_slots(fmt, config):
    _check_prefill([300, 1, 77], [300, 513, 1000], 32, 8, 128, 256, torch.bfloat16, fmt, seed=11, config=config)
