"""Qwen3's per-head q_norm and k_norm in one launch (Triton), in place on the fused qkv projection's output.

Qwen3 (HF ``Qwen3Attention``) applies an RMSNorm over head_dim to every query head (``q_norm``) and every key head
(``k_norm``) before RoPE. In the qkv output [T, (Hq + 2 Hkv) * D] the query and key heads of a token are the first
Hq + Hkv contiguous rows of D elements, so one program per (token, head) row normalizes all of them, each with its
weight (q's or k's), and writes the result back where it was: one launch instead of two RMSNorms (and no copy of
the unevenly strided q / k views at T > 1). The v columns are not touched.

Numerics are ``roofline.kernels.rmsnorm``'s (HF ``Qwen3RMSNorm``; the shared ``hf_rmsnorm_apply``): statistics and
normalization in fp32, cast to the input dtype, then times the weight, rounded to the input dtype.

The model no longer launches this kernel: the attention backend gets the norms, and the Triton backend applies them
inside ``roofline.kernels.rope_cache.rope_and_cache`` (norm, RoPE and KV store in one launch). It is the unfused
reference the fused kernel is tested against (``qk_rmsnorm_`` then ``rope_and_cache``).
"""

from __future__ import annotations

import torch

from roofline.kernels import pdl
from roofline.kernels.rmsnorm import ref_rmsnorm

try:  # triton is optional: the CPU path never imports this module's kernel.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None


def _check(qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight):
    want = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != want or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, (num_heads + 2 * num_kv_heads) * head_dim = {want}] with unit column "
                         f"stride, got shape {tuple(qkv.shape)} strides {qkv.stride()}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (head_dim,) or w.dtype != qkv.dtype:
            raise ValueError(f"{name} must be [{head_dim}] {qkv.dtype}, got {tuple(w.shape)} {w.dtype}")


def ref_qk_rmsnorm_(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, q_weight: torch.Tensor,
                    k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch twin: ``ref_rmsnorm`` of the q heads and of the k heads, written back into ``qkv``; returns qkv."""
    _check(qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight)
    t = qkv.shape[0]
    q = qkv[:, :num_heads * head_dim].view(t, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(t, num_kv_heads, head_dim)
    q.copy_(ref_rmsnorm(q, q_weight, eps))
    k.copy_(ref_rmsnorm(k, k_weight, eps))
    return qkv


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from roofline.kernels.rmsnorm import hf_rmsnorm_apply

    @triton.jit
    def _qk_rmsnorm_kernel(X, Wq, Wk, stride_t, num_heads, heads_qk, D, eps, BLOCK: tl.constexpr,
                           PDL: tl.constexpr = 0):
        if PDL:  # roofline.kernels.pdl: qkv is the previous kernel's output
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0)
        t = (row // heads_qk).to(tl.int64)
        h = row % heads_qk
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        ptrs = X + t * stride_t + h * D + cols
        x = tl.load(ptrs, mask=mask, other=0.0)
        hx = x.to(tl.float32)
        var = tl.sum(hx * hx, axis=0) / D
        if h < num_heads:
            w = tl.load(Wq + cols, mask=mask, other=0.0)
        else:
            w = tl.load(Wk + cols, mask=mask, other=0.0)
        tl.store(ptrs, hf_rmsnorm_apply(x, tl.rsqrt(var + eps), w, x.dtype), mask=mask)


def qk_rmsnorm_(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, q_weight: torch.Tensor,
                k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of every query head (weight ``q_weight``) and key head (``k_weight``) in place in ``qkv``.

    Args:
        qkv: [T, (num_heads + 2 * num_kv_heads) * head_dim] fp32/fp16/bf16, unit column stride (any row stride):
            the fused projection's output, q heads then k heads then v heads.
        q_weight, k_weight: [head_dim], qkv's dtype. eps: added to the mean square.

    Returns:
        qkv, with its q and k columns normalized (v untouched); views of it taken before see the new values.

    Raises:
        ValueError: shapes, strides or dtypes that do not fit (names them). RuntimeError: triton missing.
    """
    if triton is None:
        raise RuntimeError("triton is not installed; use ref_qk_rmsnorm_ on this machine")
    _check(qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight)
    heads_qk = num_heads + num_kv_heads
    if qkv.shape[0]:
        _qk_rmsnorm_kernel[(qkv.shape[0] * heads_qk,)](
            qkv, q_weight, k_weight, qkv.stride(0), num_heads, heads_qk, head_dim, eps,
            BLOCK=triton.next_power_of_2(head_dim), num_warps=1 if head_dim <= 256 else 4,
            **pdl.launch_kwargs(qkv.device))
    return qkv
