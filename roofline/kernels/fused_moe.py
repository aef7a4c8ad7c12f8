"""Fused mixture-of-experts: the routed experts of one MoE layer in two grouped GEMMs (the shape of vLLM's
``fused_moe`` Triton kernel), and its ``ref_`` twin, a loop over experts in pure torch.

Each token t is routed to ``top_k`` experts (``topk_ids`` [T, k], ``topk_weights`` [T, k]). Expert e computes
``down_e(silu(gate_e(x)) * up_e(x))``; the layer's output is ``sum_j topk_weights[t, j] * expert_{ids[t, j]}(x_t)``.

Weights are stacked per expert as in vLLM: ``w13`` [E, 2I, H] (gate rows [0, I), up rows [I, 2I)) and ``w2``
[E, H, I]. INT8 weight-only experts store int8 codes with per-output-channel float32 scales (``w13_scale``
[E, 2I], ``w2_scale`` [E, H]); the kernel dequantizes by scaling the fp32 accumulator (exact: the scale is
constant along K).

The grouped path (any M):
1. ``moe_align_block_size``: the (token, slot) pairs are sorted by expert and each expert's run is padded to
   a multiple of ``BLOCK_M``, so every block of rows belongs to one expert (padding rows point past the
   last pair and are masked). It runs on the device with no host sync: the buffers are sized by the worst
   case and the blocks past the real end exit at once.
2. ``_moe_gate_up_kernel``: per (block, N tile) one expert's gate and up tiles, two accumulators, SiLU-and-mul
   in registers -> ``h`` [T*k, I].
3. ``_moe_down_kernel``: ``h @ w2[e]^T`` times the pair's routing weight -> [T*k, H]; then the top-k sum
   over the k slots of each token (a fixed-order sum, so the result does not depend on scheduling).

The small-M path (decode at batch 1..``SMALL_M_MAX_TOKENS``): one program per (pair, N tile) streams its
expert's rows once as a GEMV; only the touched experts' weights are read.

Expert parallelism passes ``topk_ids`` already mapped to this rank's local experts, with -1 for pairs routed
to another rank's experts; those pairs contribute zero here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the ref_ twin still works
    triton = None

SMALL_M_MAX_TOKENS = 4  # tokens at or below which the GEMV path runs (bench moe prints both paths per M)


# --------------------------------------------------------------------------------------------- reference


def ref_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The experts one by one (Hugging Face's loop): for each expert, its tokens' rows, gate/up, SiLU-and-mul,
    down, times the routing weight, accumulated with ``index_add_`` in expert order.

    Args:
        x: [T, H] activations. w13: [E, 2I, H]; w2: [E, H, I] (float, or int8 with the scales below).
        topk_weights: [T, k] routing weights (float32). topk_ids: [T, k] local expert ids (int), -1: not here.
        w13_scale, w2_scale: [E, 2I] / [E, H] float32 per-channel scales of int8 weights (None: float weights).
        compute_dtype: the dtype of the arithmetic (default ``x.dtype``; tests pass float64).
    Returns:
        [T, H] in ``x.dtype``.
    """
    dtype = compute_dtype or x.dtype
    xc = x.to(dtype)
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    num_inter = w2.shape[2]
    for e in range(w13.shape[0]):
        tok, slot = torch.where(topk_ids == e)
        if tok.numel() == 0:
            continue
        g = w13[e].to(dtype) if w13_scale is None else w13[e].to(dtype) * w13_scale[e].to(dtype)[:, None]
        d = w2[e].to(dtype) if w2_scale is None else w2[e].to(dtype) * w2_scale[e].to(dtype)[:, None]
        gate, up = F.linear(xc[tok], g).split(num_inter, dim=-1)
        y = F.linear(F.silu(gate) * up, d) * topk_weights[tok, slot, None].to(dtype)
        out.index_add_(0, tok, y)
    return out.to(x.dtype)


def ref_fused_moe_dense(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                        w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``ref_fused_moe`` without data-dependent shapes (no host sync, so a CUDA graph can capture it): every
    expert runs on every token, weighted by the token's routing weight for it (0 where not routed). E times
    the FLOPs of the loop; the fallback for CUDA with the Triton kernels off. Same contract."""
    out = torch.zeros_like(x, dtype=torch.float32)
    num_inter = w2.shape[2]
    for e in range(w13.shape[0]):
        weight = ((topk_ids == e) * topk_weights).sum(dim=-1, dtype=torch.float32)  # [T]
        g = w13[e].to(x.dtype) if w13_scale is None else (w13[e].float() * w13_scale[e][:, None]).to(x.dtype)
        d = w2[e].to(x.dtype) if w2_scale is None else (w2[e].float() * w2_scale[e][:, None]).to(x.dtype)
        gate, up = F.linear(x, g).split(num_inter, dim=-1)
        out += F.linear(F.silu(gate) * up, d).float() * weight[:, None]
    return out.to(x.dtype)


# --------------------------------------------------------------------------------------------- alignment


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the T*k (token, slot) pairs by expert, each expert's run padded to a multiple of ``block_m``.

    Args:
        topk_ids: [T, k] int local expert ids in [0, num_experts), or -1 (the pair is not computed here).
    Returns:
        sorted_ids: [P] int32, pair index (t * k + j) per row, ``T * k`` on padding rows;
        expert_ids: [P / block_m] int32, the expert of each block of rows (-1: past the end, skip);
        num_post_padded: [1] int32, the rows in use (a device tensor: no host sync).
        P = T*k + min(T*k, E) * (block_m - 1) rounded up to block_m, the worst case.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    key = torch.where(flat >= 0, flat, num_experts)  # -1 sorts after every expert
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts:].zero_()  # a kernel, not a host scalar copy (allowed inside CUDA graph capture)
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    count_starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    rank = torch.arange(n, device=device) - count_starts[sorted_key]
    max_rows = n + min(n, num_experts) * (block_m - 1)
    max_rows = (max_rows + block_m - 1) // block_m * block_m
    dest = torch.where(sorted_key < num_experts, starts[sorted_key] + rank, max_rows)  # invalid -> scratch row
    sorted_ids = torch.full((max_rows + 1,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    expert_ids = torch.searchsorted(ends[:num_experts].contiguous(), block_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids[:max_rows], expert_ids, ends[num_experts - 1:num_experts].to(torch.int32)


# --------------------------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr):
        """acc + a @ b; fp32 inputs in full fp32 (IEEE), not TF32, so fp32 models match the fp32 loop."""
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _codes(w, FP8: tl.constexpr):
        # FP8 expert weights arrive as their bytes (Triton cannot fill a masked fp8 load with 0): bitcast at use.
        if FP8:
            w = w.to(tl.float8e4nv, bitcast=True)
        return w

    @triton.jit
    def _moe_gate_up_kernel(x_ptr, w_ptr, s_ptr, h_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
                            num_valid, N, K, stride_xm, stride_we, stride_wn, stride_se, stride_hm,
                            TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr = False):
        """h[pair, n] = silu(x[t] . w13[e, n]) * (x[t] . w13[e, N + n]) for one block of pairs of expert e."""
        pid = tl.program_id(0)
        num_n = tl.cdiv(N, BLOCK_N)
        pid_m = pid // num_n
        pid_n = pid % num_n
        num_post = tl.load(num_post_ptr)
        e = tl.load(expert_ids_ptr + pid_m)
        if pid_m * BLOCK_M < num_post and e >= 0:
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            ids = tl.load(sorted_ids_ptr + offs_m)
            mask_m = ids < num_valid
            tok = ids // TOP_K
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            w_base = w_ptr + e.to(tl.int64) * stride_we
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < K
                a = tl.load(x_ptr + tok[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                            mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                wmask = mask_k[:, None] & mask_n[None, :]
                bg = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0)
                bu = tl.load(w_base + (offs_n[None, :] + N) * stride_wn + offs_k[:, None], mask=wmask, other=0)
                acc_g = _dot(a, _codes(bg, FP8).to(a.dtype), acc_g, IEEE)
                acc_u = _dot(a, _codes(bu, FP8).to(a.dtype), acc_u, IEEE)
            if HAS_SCALE:
                s_base = s_ptr + e.to(tl.int64) * stride_se
                acc_g = acc_g * tl.load(s_base + offs_n, mask=mask_n, other=0.0)[None, :]
                acc_u = acc_u * tl.load(s_base + N + offs_n, mask=mask_n, other=0.0)[None, :]
            h = acc_g * tl.sigmoid(acc_g) * acc_u
            tl.store(h_ptr + ids[:, None].to(tl.int64) * stride_hm + offs_n[None, :],
                     h.to(h_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _moe_down_kernel(h_ptr, w_ptr, s_ptr, out_ptr, tw_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
                         num_valid, N, K, stride_hm, stride_we, stride_wn, stride_se, stride_om,
                         HAS_SCALE: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr = False):
        """out[pair, n] = topk_weight[pair] * (h[pair] . w2[e, n]) for one block of pairs of expert e."""
        pid = tl.program_id(0)
        num_n = tl.cdiv(N, BLOCK_N)
        pid_m = pid // num_n
        pid_n = pid % num_n
        num_post = tl.load(num_post_ptr)
        e = tl.load(expert_ids_ptr + pid_m)
        if pid_m * BLOCK_M < num_post and e >= 0:
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            ids = tl.load(sorted_ids_ptr + offs_m)
            mask_m = ids < num_valid
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            w_base = w_ptr + e.to(tl.int64) * stride_we
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < K
                a = tl.load(h_ptr + ids[:, None].to(tl.int64) * stride_hm + offs_k[None, :],
                            mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                b = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
                            mask=mask_k[:, None] & mask_n[None, :], other=0)
                acc = _dot(a, _codes(b, FP8).to(a.dtype), acc, IEEE)
            if HAS_SCALE:
                acc = acc * tl.load(s_ptr + e.to(tl.int64) * stride_se + offs_n, mask=mask_n, other=0.0)[None, :]
            tw = tl.load(tw_ptr + ids, mask=mask_m, other=0.0)
            acc = acc * tw[:, None]
            tl.store(out_ptr + ids[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _moe_gemv_kernel(a_ptr, w_ptr, s_ptr, out_ptr, tw_ptr, ids_ptr, N, K, stride_am, stride_we, stride_wn,
                         stride_se, stride_om, A_ROW_DIV: tl.constexpr, GATE_UP: tl.constexpr,
                         HAS_SCALE: tl.constexpr, MUL_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, FP8: tl.constexpr = False):
        """The small-M path: program (pair, N tile) streams expert ids[pair]'s rows [n-tile] (and, for
        gate_up, the matching up rows) once; a GEMV against the pair's activation row a[pair // A_ROW_DIV]."""
        pair = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(ids_ptr + pair)
        if e >= 0:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            a_row = a_ptr + (pair // A_ROW_DIV).to(tl.int64) * stride_am
            w_base = w_ptr + e.to(tl.int64) * stride_we
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < K
                a = tl.load(a_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
                wmask = mask_n[:, None] & mask_k[None, :]
                w = tl.load(w_base + offs_n[:, None] * stride_wn + offs_k[None, :], mask=wmask, other=0)
                acc += tl.sum(_codes(w, FP8).to(tl.float32) * a[None, :], axis=1)
                if GATE_UP:
                    wu = tl.load(w_base + (offs_n[:, None] + N) * stride_wn + offs_k[None, :], mask=wmask, other=0)
                    acc_u += tl.sum(_codes(wu, FP8).to(tl.float32) * a[None, :], axis=1)
            if HAS_SCALE:
                s_base = s_ptr + e.to(tl.int64) * stride_se
                acc = acc * tl.load(s_base + offs_n, mask=mask_n, other=0.0)
                if GATE_UP:
                    acc_u = acc_u * tl.load(s_base + N + offs_n, mask=mask_n, other=0.0)
            if GATE_UP:
                acc = acc * tl.sigmoid(acc) * acc_u
            if MUL_WEIGHT:
                acc = acc * tl.load(tw_ptr + pair)
            tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty),
                     mask=mask_n)


def _gemv_block_n(num_pairs: int, n: int, device: torch.device) -> int:
    """Rows per GEMV program: the widest tile that still gives >= 4 programs per SM (at batch 1 a layer has few
    pairs, and a GEMV is bound by the bytes in flight, so the grid must cover every SM several times)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    for bn in (64, 32):
        if num_pairs * triton.cdiv(n, bn) >= 4 * sms:
            return bn
    return 16


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: the expected pairs per expert, rounded to 16..64 (16 is tl.dot's minimum)."""
    per_expert = num_pairs / max(1, num_experts)
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None) -> None:
    num_experts, two_i, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must be [T, {hidden}], got {tuple(x.shape)}")
    if tuple(w2.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(f"w2 must be [{num_experts}, {hidden}, {two_i // 2}], got {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must "
                         f"both be [T={x.shape[0]}, k]")
    coded = w2.dtype in (torch.int8, torch.float8_e4m3fn)
    if (w13_scale is None) == coded or (w2_scale is None) == coded or w13.dtype != w2.dtype:
        raise ValueError(f"int8/fp8 expert weights need w13_scale and w2_scale, 16-bit ones none (w13 {w13.dtype}, "
                         f"w2 {w2.dtype}, scales given: {w13_scale is not None}, {w2_scale is not None})")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1 or not x.is_contiguous():
        raise ValueError("x and the expert weights must be contiguous along their last dim")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              small_m: bool | None = None) -> torch.Tensor:
    """The routed experts of one MoE layer (see the module docstring); same contract as ``ref_fused_moe``.

    Args:
        x: [T, H] fp16/bf16/fp32, contiguous. w13 [E, 2I, H], w2 [E, H, I]: x's dtype, or int8 with
            ``w13_scale`` [E, 2I] / ``w2_scale`` [E, H] float32. topk_weights [T, k] float; topk_ids [T, k] int
            (local ids, -1: another rank's expert).
        small_m: force the GEMV path (True) or the grouped path (False); None: GEMV for T <= SMALL_M_MAX_TOKENS.
    Returns:
        [T, H] in x's dtype: the top-k sum, accumulated in fp32 within each expert's GEMMs.
    Raises:
        ValueError: shapes or dtypes that do not fit together (names them).
    """
    _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(x)
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    has_scale = w13_scale is not None
    s13 = w13_scale if has_scale else tw  # a dummy pointer when unused
    s2 = w2_scale if has_scale else tw
    fp8 = w13.dtype == torch.float8_e4m3fn
    if fp8:  # the kernels read E4M3 codes as bytes and bitcast them (see _codes)
        w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    local = bool((topk_ids < 0).any()) if not x.is_cuda else None  # CPU: cheap; CUDA: zero-fill below
    out = (torch.zeros if local is not False else torch.empty)(num_pairs, hidden, dtype=x.dtype, device=x.device)
    if small_m if small_m is not None else num_tokens <= SMALL_M_MAX_TOKENS:
        ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
        bk = 128
        bn = _gemv_block_n(num_pairs, inter, x.device)
        _moe_gemv_kernel[(num_pairs, triton.cdiv(inter, bn))](
            x, w13, s13, h, tw, ids, inter, hidden, x.stride(0), w13.stride(0), w13.stride(1),
            s13.stride(0) if has_scale else 0, h.stride(0), A_ROW_DIV=top_k, GATE_UP=True, HAS_SCALE=has_scale,
            MUL_WEIGHT=False, BLOCK_N=bn, BLOCK_K=bk, FP8=fp8)
        bn = _gemv_block_n(num_pairs, hidden, x.device)
        _moe_gemv_kernel[(num_pairs, triton.cdiv(hidden, bn))](
            h, w2, s2, out, tw, ids, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1),
            s2.stride(0) if has_scale else 0, out.stride(0), A_ROW_DIV=1, GATE_UP=False, HAS_SCALE=has_scale,
            MUL_WEIGHT=True, BLOCK_N=bn, BLOCK_K=bk, FP8=fp8)
    else:
        bm = _block_m(num_pairs, num_experts)
        ieee = x.dtype == torch.float32
        bn, bk = 64, 64
        sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, num_experts, bm)
        num_blocks = expert_ids.numel()
        _moe_gate_up_kernel[(num_blocks * triton.cdiv(inter, bn),)](
            x, w13, s13, h, sorted_ids, expert_ids, num_post, num_pairs, inter, hidden, x.stride(0),
            w13.stride(0), w13.stride(1), s13.stride(0) if has_scale else 0, h.stride(0), TOP_K=top_k,
            HAS_SCALE=has_scale, IEEE=ieee, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, FP8=fp8)
        _moe_down_kernel[(num_blocks * triton.cdiv(hidden, bn),)](
            h, w2, s2, out, tw, sorted_ids, expert_ids, num_post, num_pairs, hidden, inter, h.stride(0),
            w2.stride(0), w2.stride(1), s2.stride(0) if has_scale else 0, out.stride(0), HAS_SCALE=has_scale,
            IEEE=ieee, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, FP8=fp8)
    # The top-k sum in a fixed order (slot 0, 1, ...), in fp32.
    return out.view(num_tokens, top_k, hidden).float().sum(dim=1).to(x.dtype)
