"""Rotary embedding on q and k fused with writing k and v into the paged KV cache (Triton), optionally after
Qwen3's per-head q/k RMSNorm.

RoPE (Su et al. 2021, RoFormer) in the rotate-half ("neox", Hugging Face) layout: with x1 = x[:D/2],
x2 = x[D/2:] and angle theta_i(pos),
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
``cos_sin_cache`` is [max_positions, D] fp32 = cat(cos[:, :D/2], sin[:, :D/2]), so one row holds every
angle a token needs (Llama-3.1 / YaRN scaling is baked into the table by whoever builds it).
The rotation runs in fp32 and rounds once to the input dtype.

One program handles one token: all H query heads, all H_kv key heads, and the k/v rows it writes to the
cache at ``slot_mapping[t]`` (layout [num_blocks, block_size, H_kv, D], slot = block*block_size + off).
A negative slot (a padded token of a CUDA-graph batch) rotates q/k but writes nothing to the cache.

Qwen3's q_norm / k_norm (HF ``Qwen3Attention``: an RMSNorm over head_dim of every query and key head, before
RoPE) can run in the same program (``q_norm_weight``, ``k_norm_weight``, ``norm_eps``): each (token, head) row
of q and of k is normalized with HF ``Qwen3RMSNorm``'s rounding (``roofline.kernels.rmsnorm``: statistics in
fp32, ``x * rsqrt(mean(x^2) + eps)`` cast to the input dtype, times the weight in fp32, rounded to the input
dtype), then rotated from those rounded values, so the layer makes one launch where it made two.

Quantized caches (int8, float8_e4m3fn; formats in ``roofline.kernels.common``) are quantized here, from
the rotated k (rounded to k's dtype, as written back to k) and from v: int8 computes each (token, KV head)
amax over D in registers and writes the codes and the float32 scale; fp8 divides by the layer's static
per-head scale and saturates to +-448. Divisions are IEEE (``tl.div_rn``) so codes equal the ref's.
"""

from __future__ import annotations

import torch

from roofline.kernels import pdl
from roofline.kernels.common import (
    FP8_E4M3_MAX,
    INT8_MAX,
    KV_QUANT_NONE,
    KV_QUANT_PER_TOKEN,
    kv_quant_mode,
    ref_quantize_fp8,
    ref_quantize_int8,
)
from roofline.kernels.rmsnorm import ref_rmsnorm

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def ref_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [T, H, D] and k [T, H_kv, D] at ``positions`` [T]; fp32 math, returns new
    tensors in the inputs' dtypes."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()].float()  # [T, D]
    cos, sin = cs[:, None, :half], cs[:, None, half:]  # [T, 1, D/2]

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rot(q), rot(k)


def ref_write_kv_rows(k, v, k_cache, v_cache, slots, k_scale=None, v_scale=None) -> None:
    """Write k, v [N, H_kv, D] at ``slots`` [N] (all valid), quantizing for an int8/fp8 cache (formats in
    ``roofline.kernels.common``; int8 also writes the per-slot scales)."""
    mode = kv_quant_mode(k_cache, k_scale, v_scale)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    kc = k_cache.view(num_slots, *k_cache.shape[2:])
    vc = v_cache.view(num_slots, *v_cache.shape[2:])
    if mode == KV_QUANT_NONE:
        kc[slots] = k.to(k_cache.dtype)
        vc[slots] = v.to(v_cache.dtype)
    elif mode == KV_QUANT_PER_TOKEN:
        assert k_scale is not None and v_scale is not None
        for x, cache, sc in ((k, kc, k_scale), (v, vc, v_scale)):
            codes, scale = ref_quantize_int8(x)
            cache[slots] = codes
            sc.view(num_slots, -1)[slots] = scale
    else:
        assert k_scale is not None and v_scale is not None
        kc[slots] = ref_quantize_fp8(k, k_scale)
        vc[slots] = ref_quantize_fp8(v, v_scale)


def ref_store_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Pure-torch twin of :func:`store_kv_cache`: rows with a negative slot (padding) are not written."""
    valid = slot_mapping >= 0
    ref_write_kv_rows(k[valid], v[valid], k_cache, v_cache, slot_mapping[valid], k_scale, v_scale)


def ref_rope_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float | None = None,
) -> None:
    """Pure-torch twin of :func:`rope_and_cache` (same in-place effects on q, k, the caches and scales): with
    the norm weights, ``ref_rmsnorm`` of q and of k (HF ``Qwen3RMSNorm``) before ``ref_rotary``."""
    _check_qk_norm(q, k, q_norm_weight, k_norm_weight, norm_eps)
    if q_norm_weight is not None:
        q_rot, k_rot = ref_rotary(positions, ref_rmsnorm(q, q_norm_weight, norm_eps),
                                  ref_rmsnorm(k, k_norm_weight, norm_eps), cos_sin_cache)
    else:
        q_rot, k_rot = ref_rotary(positions, q, k, cos_sin_cache)
    q.copy_(q_rot)
    k.copy_(k_rot)
    ref_store_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from roofline.kernels.rmsnorm import hf_rmsnorm_apply

    INT8_MAX_C = tl.constexpr(INT8_MAX)
    FP8_MAX_C = tl.constexpr(FP8_E4M3_MAX)

    @triton.jit
    def _quantize(x, scale, QUANT: tl.constexpr, CODE_T: tl.constexpr):
        """x [BLOCK_HKV, N] fp32 / scale [BLOCK_HKV] fp32 -> codes (int8: round half up, clamp +-127;
        fp8: clamp +-448, round to nearest even). A zero scale (all-zero int8 row, masked head) gives 0."""
        s = scale[:, None] + tl.zeros_like(x)  # explicit broadcast: div_rn takes equal shapes
        y = tl.where(s > 0, tl.div_rn(x, tl.where(s > 0, s, 1.0)), 0.0)
        if QUANT == 1:
            y = tl.floor(y + 0.5)
            y = tl.minimum(tl.maximum(y, -INT8_MAX_C), INT8_MAX_C)
        else:
            y = tl.minimum(tl.maximum(y, -FP8_MAX_C), FP8_MAX_C)
        return y.to(CODE_T)

    @triton.jit
    def _rmsnorm_halves(x1, x2, W, offs_half, half_mask, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
        """HF Qwen3RMSNorm of rows held as halves x1 = x[:, :D/2], x2 = x[:, D/2:] ([rows, HALF_P2], masked
        lanes 0): the mean square of both halves over HEAD_DIM in fp32, weight W [HEAD_DIM]; x's dtype out."""
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(W + offs_half, mask=half_mask, other=0.0)[None, :]
        w2 = tl.load(W + HALF + offs_half, mask=half_mask, other=0.0)[None, :]
        return hf_rmsnorm_apply(x1, rstd, w1, x1.dtype), hf_rmsnorm_apply(x2, rstd, w2, x2.dtype)

    @triton.jit
    def _rope_cache_kernel(
        Q, K, V, Pos, CosSin, KC, VC, Slots, KS, VS, WQ, WK,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_cs, stride_kc_slot, stride_kc_h, stride_vc_slot, stride_vc_h, stride_s_slot,
        num_heads, num_kv_heads, eps,
        HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr,
        APPLY_ROPE: tl.constexpr, QK_NORM: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr = 0,
    ):
        if PDL:  # roofline.kernels.pdl: every load and store below depends on the previous kernel
            gdc_wait()
            gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(Slots + t).to(tl.int64)
        offs_half = tl.arange(0, HALF_P2)
        offs_kh = tl.arange(0, BLOCK_HKV)
        # k is handled as two [BLOCK_HKV, HALF_P2] halves so the rotated values go to q/k and the cache
        # straight from registers (no re-read of what this program wrote).
        kmask = (offs_kh < num_kv_heads)[:, None] & (offs_half < HALF)[None, :]
        k_ptr = K + t * stride_kt + offs_kh[:, None] * stride_kh + offs_half[None, :]
        k1 = tl.load(k_ptr, mask=kmask, other=0.0)
        k2 = tl.load(k_ptr + HALF, mask=kmask, other=0.0)
        if APPLY_ROPE:
            pos = tl.load(Pos + t).to(tl.int64)
            cs_mask = offs_half < HALF
            cos = tl.load(CosSin + pos * stride_cs + offs_half, mask=cs_mask, other=0.0)[None, :]
            sin = tl.load(CosSin + pos * stride_cs + HALF + offs_half, mask=cs_mask, other=0.0)[None, :]
            # q: [BLOCK_H, HALF_P2] halves of all H query heads of this token.
            offs_h = tl.arange(0, BLOCK_H)
            qmask = (offs_h < num_heads)[:, None] & (offs_half < HALF)[None, :]
            q_ptr = Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_half[None, :]
            q1 = tl.load(q_ptr, mask=qmask, other=0.0)
            q2 = tl.load(q_ptr + HALF, mask=qmask, other=0.0)
            if QK_NORM:  # Qwen3: RMSNorm of every q and k head (weights WQ, WK), rounded, then rotated
                q1, q2 = _rmsnorm_halves(q1, q2, WQ, offs_half, cs_mask, eps, HEAD_DIM, HALF)
                k1, k2 = _rmsnorm_halves(k1, k2, WK, offs_half, cs_mask, eps, HEAD_DIM, HALF)
            f1 = q1.to(tl.float32)
            f2 = q2.to(tl.float32)
            tl.store(q_ptr, (f1 * cos - f2 * sin).to(q1.dtype), mask=qmask)
            tl.store(q_ptr + HALF, (f2 * cos + f1 * sin).to(q1.dtype), mask=qmask)
            f1 = k1.to(tl.float32)
            f2 = k2.to(tl.float32)
            k1 = (f1 * cos - f2 * sin).to(k1.dtype)
            k2 = (f2 * cos + f1 * sin).to(k2.dtype)
            tl.store(k_ptr, k1, mask=kmask)
            tl.store(k_ptr + HALF, k2, mask=kmask)
        if slot >= 0:
            kc_ptr = KC + slot * stride_kc_slot + offs_kh[:, None] * stride_kc_h + offs_half[None, :]
            offs_d = tl.arange(0, BLOCK_D)
            vmask = (offs_kh < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
            v = tl.load(V + t * stride_vt + offs_kh[:, None] * stride_vh + offs_d[None, :], mask=vmask, other=0.0)
            vc_ptr = VC + slot * stride_vc_slot + offs_kh[:, None] * stride_vc_h + offs_d[None, :]
            if QUANT == 0:
                tl.store(kc_ptr, k1.to(KC.dtype.element_ty), mask=kmask)
                tl.store(kc_ptr + HALF, k2.to(KC.dtype.element_ty), mask=kmask)
                tl.store(vc_ptr, v.to(VC.dtype.element_ty), mask=vmask)
            else:
                hmask = offs_kh < num_kv_heads
                f1 = k1.to(tl.float32)  # the rotated k as written back to K (rounded to its dtype)
                f2 = k2.to(tl.float32)
                fv = v.to(tl.float32)
                if QUANT == 1:
                    # int8, per token and KV head: scale = amax / 127 over D (masked lanes are 0).
                    k_amax = tl.maximum(tl.max(tl.abs(f1), axis=1), tl.max(tl.abs(f2), axis=1))
                    qmax = tl.full([BLOCK_HKV], INT8_MAX_C, tl.float32)
                    ks = tl.div_rn(k_amax, qmax)
                    vs = tl.div_rn(tl.max(tl.abs(fv), axis=1), qmax)
                    tl.store(KS + slot * stride_s_slot + offs_kh, ks, mask=hmask)
                    tl.store(VS + slot * stride_s_slot + offs_kh, vs, mask=hmask)
                else:
                    # fp8 e4m3, the layer's static per-head scales.
                    ks = tl.load(KS + offs_kh, mask=hmask, other=0.0)
                    vs = tl.load(VS + offs_kh, mask=hmask, other=0.0)
                tl.store(kc_ptr, _quantize(f1, ks, QUANT, KC.dtype.element_ty), mask=kmask)
                tl.store(kc_ptr + HALF, _quantize(f2, ks, QUANT, KC.dtype.element_ty), mask=kmask)
                tl.store(vc_ptr, _quantize(fv, vs, QUANT, VC.dtype.element_ty), mask=vmask)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         "[num_blocks, block_size, num_kv_heads, head_dim]")
    # slot indexing needs block and in-block strides to agree (a contiguous cache, or a layer's slice of one).
    if k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1) or v_cache.stride(0) != v_cache.shape[1] * v_cache.stride(1):
        raise ValueError("k_cache/v_cache must have stride(0) == block_size * stride(1)")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache last dim must be contiguous")


def _check_qk_norm(q, k, q_norm_weight, k_norm_weight, norm_eps) -> None:
    if q_norm_weight is None and k_norm_weight is None:
        return
    if q_norm_weight is None or k_norm_weight is None or norm_eps is None:
        raise ValueError("q_norm_weight, k_norm_weight and norm_eps go together")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w.shape != (k.shape[-1],) or w.dtype != q.dtype or w.dtype != k.dtype or w.stride(0) != 1:
            raise ValueError(f"{name} must be [{k.shape[-1]}] contiguous {q.dtype} (q's and k's dtype), got "
                             f"{tuple(w.shape)} {w.dtype} stride {w.stride()}")


def _launch(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, apply_rope: bool,
            k_scale=None, v_scale=None, q_norm_weight=None, k_norm_weight=None, norm_eps=None) -> None:
    if triton is None:
        raise RuntimeError("triton is not installed; use the ref_ twin on this machine")
    _check_cache(k_cache, v_cache)
    quant = kv_quant_mode(k_cache, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} and cache {tuple(k_cache.shape)} disagree")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} last dim must be contiguous")
    num_heads = q.shape[1] if q is not None else 1
    if apply_rope:
        if cos_sin_cache.shape[-1] != head_dim:
            raise ValueError(f"cos_sin_cache last dim {cos_sin_cache.shape[-1]} must equal even head_dim {head_dim}")
        if q.shape[0] != num_tokens or q.shape[2] != head_dim:
            raise ValueError(f"q {tuple(q.shape)} must be [{num_tokens}, H, {head_dim}]")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    _check_qk_norm(q, k, q_norm_weight, k_norm_weight, norm_eps)
    qk_norm = q_norm_weight is not None
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rope_cache_kernel[(num_tokens,)](
        q if apply_rope else k, k, v,
        positions if apply_rope else slot_mapping,
        cos_sin_cache if apply_rope else k,
        k_cache, v_cache, slot_mapping,
        k_scale if k_scale is not None else k, v_scale if v_scale is not None else v,
        q_norm_weight if qk_norm else k, k_norm_weight if qk_norm else k,
        q.stride(0) if apply_rope else 0, q.stride(1) if apply_rope else 0,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0) if apply_rope else 0,
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads if quant == KV_QUANT_PER_TOKEN else 0,  # scale slot stride ([num_slots, H_kv] view)
        num_heads, num_kv_heads, norm_eps if qk_norm else 0.0,
        HEAD_DIM=head_dim, HALF=half, HALF_P2=triton.next_power_of_2(max(half, 1)),
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), APPLY_ROPE=apply_rope, QK_NORM=qk_norm, QUANT=quant,
        num_warps=4,
        **pdl.launch_kwargs(k.device),
    )


def rope_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float | None = None,
) -> None:
    """Rotate q and k in place (rotate-half RoPE) and store rotated k and v at their cache slots; with the
    norm weights, RMSNorm every q and k head first (Qwen3's q_norm / k_norm, see the module docstring).

    Args:
        q: [T, H, D] (modified in place), k: [T, H_kv, D] (modified in place), v: [T, H_kv, D];
            fp32/fp16/bf16, last dim contiguous.
        positions: [T] int32/int64 absolute token positions (< max_positions).
        cos_sin_cache: [max_positions, D] fp32, row = cat(cos(pos*inv_freq), sin(pos*inv_freq)).
        k_cache, v_cache: [num_blocks, block_size, H_kv, D] fp32/fp16/bf16, int8 or float8_e4m3fn;
            slot s is (s // block_size, s % block_size).
        slot_mapping: [T] int64 cache slot per token; negative = padding, not written.
        k_scale, v_scale: float32 scales of a quantized cache (``roofline.kernels.common``): int8
            [num_blocks, block_size, H_kv], written here per stored token; fp8 [H_kv], read.
        q_norm_weight, k_norm_weight: optional [D] contiguous, q's (and k's) dtype: HF ``Qwen3RMSNorm`` weights
            of q_norm and k_norm, applied per (token, head) row before the rotation; q and k end normalized
            and rotated, and the cache gets the normalized, rotated k. norm_eps: their eps (needed with them).

    Raises:
        ValueError: shapes disagree, D odd, non-contiguous last dims, scales that do not fit the cache
            dtype, or norm weights of the wrong shape or dtype, or given without each other or norm_eps.
            RuntimeError: triton missing.
    """
    _launch(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, True, k_scale, v_scale,
            q_norm_weight, k_norm_weight, norm_eps)


def store_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Write k, v ([T, H_kv, D]) into the paged cache at ``slot_mapping`` ([T] int64; negative = skip),
    quantizing for an int8/fp8 cache as :func:`rope_and_cache` does."""
    _launch(None, k, v, None, None, k_cache, v_cache, slot_mapping, False, k_scale, v_scale)
