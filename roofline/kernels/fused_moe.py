"""Fused mixture-of-experts: the routed experts of one MoE layer in two grouped GEMMs (the shape of vLLM's
``fused_moe`` Triton kernel), and its ``ref_`` twin, a loop over experts in pure torch.

Each token t is routed to ``top_k`` experts (``topk_ids`` [T, k], ``topk_weights`` [T, k]). Expert e computes
``down_e(silu(gate_e(x)) * up_e(x))``; the layer's output is ``sum_j topk_weights[t, j] * expert_{ids[t, j]}(x_t)``.

Weights are stacked per expert as in vLLM: ``w13`` [E, 2I, H] (gate rows [0, I), up rows [I, 2I)) and ``w2``
[E, H, I]. INT8 weight-only experts store int8 codes with per-output-channel float32 scales (``w13_scale``
[E, 2I], ``w2_scale`` [E, H]); the kernel dequantizes by scaling the fp32 accumulator (exact: the scale is
constant along K).

Three paths, picked per (E, I, H, format, M) by ``fused_moe_config.get_config`` (the table measured on the
device by ``bench/gpu_moe_tune.py``, else a heuristic by M):

- grouped (any M):
  1. ``moe_align_block_size``: the (token, slot) pairs are sorted by expert and each expert's run is padded
     to a multiple of ``BLOCK_M``, so every block of rows belongs to one expert (padding rows point past the
     last pair and are masked). One Triton program, no host sync: the buffers are sized by the worst case and
     the blocks past the real end exit at once.
  2. ``_moe_gate_up_kernel``: per (block, N tile) one expert's gate and up tiles, two accumulators,
     SiLU-and-mul in registers -> ``h`` [T*k, I].
  3. ``_moe_down_kernel``: ``h @ w2[e]^T`` times the pair's routing weight -> [T*k, H]; then the top-k sum
     over the k slots of each token (a fixed-order sum, so the result does not depend on scheduling).
  Both GEMMs walk their tiles with the GROUP_M swizzle (row blocks of one expert share a weight tile in L2).
- gemv (decode at small M): gate_up, one program per (pair, ``block_n`` rows), streams its expert's rows
  once; down, one program per (token, ``down_block_n`` rows), streams those rows of each of the token's k
  experts in one loop and writes the weighted top-k sum itself. Only the touched experts' weights are read.
- loop: the expert loop (``ref_fused_moe``, cuBLAS per expert), where the table measured it faster; outside
  CUDA-graph capture only (it syncs with the host).

Expert parallelism passes ``topk_ids`` already mapped to this rank's local experts, with -1 for pairs routed
to another rank's experts; those pairs contribute zero here.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the ref_ twin still works
    triton = None

from roofline.kernels.fused_moe_config import MoeConfig, default_config, get_config
from roofline.kernels.pdl import mode as pdl_mode

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


def ref_moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the T*k (token, slot) pairs by expert, each expert's run padded to a multiple of ``block_m`` (torch
    ops, stable: pairs in pair order within an expert).

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
    max_rows = _max_rows(n, num_experts, block_m)
    dest = torch.where(sorted_key < num_experts, starts[sorted_key] + rank, max_rows)  # invalid -> scratch row
    sorted_ids = torch.full((max_rows + 1,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    expert_ids = torch.searchsorted(ends[:num_experts].contiguous(), block_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids[:max_rows], expert_ids, ends[num_experts - 1:num_experts].to(torch.int32)


def _max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    rows = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return (rows + block_m - 1) // block_m * block_m


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ref_moe_align_block_size``'s contract in one Triton launch (one program, no host sync; vLLM's
    ``moe_align_block_size``): a histogram of the expert ids, the padded prefix sum, the block -> expert map, then
    each pair placed at its expert's cursor by an atomic add. The order of the pairs inside an expert's run is
    therefore not fixed on a GPU; the kernels compute each row on its own, so the result does not depend on it.
    Falls back to the torch ops where Triton cannot run (no Triton; CPU without ``TRITON_INTERPRET=1``)."""
    if triton is None or not (topk_ids.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return ref_moe_align_block_size(topk_ids, num_experts, block_m)
    device = topk_ids.device
    n = topk_ids.numel()
    max_rows = _max_rows(n, num_experts, block_m)
    num_blocks = max_rows // block_m
    sorted_ids = torch.empty(max_rows, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    e_pad = triton.next_power_of_2(num_experts)
    cursor = torch.empty(e_pad, dtype=torch.int32, device=device)
    _moe_align_kernel[(1,)](topk_ids.reshape(-1), sorted_ids, expert_ids, num_post, cursor, n, max_rows, num_blocks,
                            BLOCK_M=block_m, E_PAD=e_pad, CHUNK=1024, CHUNK_B=max(16, 8192 // e_pad),
                            num_warps=8)
    return sorted_ids, expert_ids, num_post


# --------------------------------------------------------------------------------------------- kernels

if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit(do_not_specialize=["num_pairs", "max_rows", "num_blocks"])
    def _moe_align_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr, cursor_ptr, num_pairs, max_rows,
                          num_blocks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                          CHUNK_B: tl.constexpr):
        """One program: counts -> padded starts -> expert of each block -> pairs scattered (see
        ``moe_align_block_size``). Experts >= E (the power-of-two padding) count 0 and own no block."""
        offs_e = tl.arange(0, E_PAD)
        counts = tl.zeros([E_PAD], dtype=tl.int32)
        for c0 in range(0, num_pairs, CHUNK):
            offs = c0 + tl.arange(0, CHUNK)
            e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
            valid = e >= 0
            counts += tl.histogram(tl.where(valid, e, 0), E_PAD, mask=valid)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)
        total = tl.sum(padded, 0)
        tl.store(num_post_ptr, total)
        tl.store(cursor_ptr + offs_e, ends - padded)
        for b0 in range(0, num_blocks, CHUNK_B):
            offs_b = b0 + tl.arange(0, CHUNK_B)
            row0 = offs_b * BLOCK_M
            owner = tl.sum((ends[None, :] <= row0[:, None]).to(tl.int32), axis=1)  # experts ending at or before
            tl.store(expert_ids_ptr + offs_b, tl.where(row0 < total, owner, -1), mask=offs_b < num_blocks)
        for r0 in range(0, max_rows, CHUNK):
            offs = r0 + tl.arange(0, CHUNK)
            tl.store(sorted_ids_ptr + offs, tl.zeros([CHUNK], tl.int32) + num_pairs, mask=offs < max_rows)
        tl.debug_barrier()  # the cursors and the padding fill are visible to every thread of the program
        for c0 in range(0, num_pairs, CHUNK):
            offs = c0 + tl.arange(0, CHUNK)
            e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
            valid = e >= 0
            row = tl.atomic_add(cursor_ptr + tl.where(valid, e, 0), 1, mask=valid)
            tl.store(sorted_ids_ptr + row, offs, mask=valid)

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
    def _codes_f32(w, FP8: tl.constexpr, INT8: tl.constexpr):
        # Codes -> fp32 values (before the channel scale). INT8: 0x4B000080 + q is the float 2^23 + 128 + q
        # (q in [-128, 127]), one integer add and one float subtract (quant_gemv's conversion).
        if FP8:
            return w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif INT8:
            return (w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        else:
            return w.to(tl.float32)

    @triton.jit
    def _tile_ids(pid, num_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        # (block of rows, column tile) of program pid: GROUP_M consecutive row blocks walk one column tile
        # before the next (the L2 swizzle of Triton's matmul tutorial), so the row blocks of one expert read
        # each weight tile from DRAM once. GROUP_M = 1: the column tiles of a row block are neighbours.
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        size_m = tl.minimum(num_blocks - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
        return pid_m, pid_n

    # Runtime counts are not specialized (divisible-by-16 or == 1 would compile a variant per M).
    @triton.jit(do_not_specialize=["num_valid", "num_blocks", "top_k"])
    def _moe_gate_up_kernel(x_ptr, w_ptr, s_ptr, h_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
                            num_valid, num_blocks, top_k, N, K, stride_xm, stride_we, stride_wn, stride_se, stride_hm,
                            HAS_SCALE: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                            FP8: tl.constexpr = False):
        """h[pair, n] = silu(x[t] . w13[e, n]) * (x[t] . w13[e, N + n]) for one block of pairs of expert e."""
        pid_m, pid_n = _tile_ids(tl.program_id(0), num_blocks, N, BLOCK_N, GROUP_M)
        num_post = tl.load(num_post_ptr)
        e = tl.load(expert_ids_ptr + pid_m)
        if pid_m * BLOCK_M < num_post and e >= 0:
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            ids = tl.load(sorted_ids_ptr + offs_m)
            mask_m = ids < num_valid
            tok = ids // top_k
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

    @triton.jit(do_not_specialize=["num_valid", "num_blocks"])
    def _moe_down_kernel(h_ptr, w_ptr, s_ptr, out_ptr, tw_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
                         num_valid, num_blocks, N, K, stride_hm, stride_we, stride_wn, stride_se, stride_om,
                         HAS_SCALE: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         FP8: tl.constexpr = False):
        """out[pair, n] = topk_weight[pair] * (h[pair] . w2[e, n]) for one block of pairs of expert e."""
        pid_m, pid_n = _tile_ids(tl.program_id(0), num_blocks, N, BLOCK_N, GROUP_M)
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

    @triton.jit(do_not_specialize=["a_row_div"])
    def _moe_gemv_kernel(a_ptr, w_ptr, s_ptr, out_ptr, ids_ptr, N, K, a_row_div, stride_am, stride_we,
                         stride_wn, stride_se, stride_om, HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FP8: tl.constexpr = False,
                         INT8: tl.constexpr = False, PDL: tl.constexpr = 0):
        """The small-M gate_up: program (pair, N tile) streams expert ids[pair]'s gate rows [n-tile] and the
        matching up rows once; a GEMV against the pair's activation row a[pair // a_row_div], SiLU-and-mul in
        registers -> h[pair, n-tile].

        As ``quant_gemv``'s one-row stream: [BLOCK_N, BLOCK_K] tiles with 16-byte loads along K, the next tile's
        loads issued before this tile's FMAs (register double buffering, one tile of DRAM latency in flight per
        program), products accumulated element-wise and reduced over K once after the loop.

        PDL (``roofline.kernels.pdl``; 0 off): waits for the previous kernel first (the expert ids come from the
        router) and then releases the next one (the down kernel, which streams its first weight tile early)."""
        pair = tl.program_id(0)
        pid_n = tl.program_id(1)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        e = tl.load(ids_ptr + pair)
        if e >= 0:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            offs_k = tl.arange(0, BLOCK_K)
            w_base = w_ptr + e.to(tl.int64) * stride_we
            g_ptrs = w_base + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BN, BK]
            u_ptrs = g_ptrs + N * stride_wn
            # x through [BN, BK] pointers (every row the same): the load takes the weight tile's layout.
            x_ptrs = a_ptr + (pair // a_row_div).to(tl.int64) * stride_am + offs_k[None, :] + 0 * offs_n[:, None]
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            last = (tl.cdiv(K, BLOCK_K) - 1) * BLOCK_K
            kin = offs_k < K
            if EVEN_K:
                g_next = tl.load(g_ptrs, mask=mask_n[:, None], other=0)
                u_next = tl.load(u_ptrs, mask=mask_n[:, None], other=0)
                x_next = tl.load(x_ptrs)
            else:
                g_next = tl.load(g_ptrs, mask=mask_n[:, None] & kin[None, :], other=0)
                u_next = tl.load(u_ptrs, mask=mask_n[:, None] & kin[None, :], other=0)
                x_next = tl.load(x_ptrs, mask=kin[None, :], other=0.0)
            for k0 in range(0, K, BLOCK_K):
                g = g_next
                u = u_next
                x = x_next.to(tl.float32)
                # Prefetch the next tile (the last iteration re-reads its own tile, an L1/L2 hit).
                k1 = tl.minimum(k0 + BLOCK_K, last)
                if EVEN_K:
                    g_next = tl.load(g_ptrs + k1, mask=mask_n[:, None], other=0)
                    u_next = tl.load(u_ptrs + k1, mask=mask_n[:, None], other=0)
                    x_next = tl.load(x_ptrs + k1)
                else:
                    kin = (k1 + offs_k) < K
                    g_next = tl.load(g_ptrs + k1, mask=mask_n[:, None] & kin[None, :], other=0)
                    u_next = tl.load(u_ptrs + k1, mask=mask_n[:, None] & kin[None, :], other=0)
                    x_next = tl.load(x_ptrs + k1, mask=kin[None, :], other=0.0)
                acc += x * _codes_f32(g, FP8, INT8)
                acc_u += x * _codes_f32(u, FP8, INT8)
            out = tl.sum(acc, axis=1)
            up = tl.sum(acc_u, axis=1)
            if HAS_SCALE:
                s_base = s_ptr + e.to(tl.int64) * stride_se
                out = out * tl.load(s_base + offs_n, mask=mask_n, other=0.0)
                up = up * tl.load(s_base + N + offs_n, mask=mask_n, other=0.0)
            out = out * tl.sigmoid(out) * up
            tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, out.to(out_ptr.dtype.element_ty),
                     mask=mask_n)

    @triton.jit
    def _gate_up_tile(t, nk, pid, nprog, n_tiles, offs_n0, offs_k, ids_ptr, a_ptr, w_ptr, N, K, a_row_div,
                      stride_am, stride_we, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr):
        # Pointers and masks of a persistent program's tile t (work item pid + (t // nk) * nprog, K tile t % nk):
        # [BLOCK_N, BLOCK_K] of the expert's gate rows (the up rows are N rows further), and x through the same
        # layout. A pair routed to another rank (id -1) reads nothing.
        item = pid + (t // nk) * nprog
        k0 = (t % nk) * BLOCK_K
        pair = item // n_tiles
        offs_n = (item % n_tiles) * BLOCK_N + offs_n0
        e = tl.load(ids_ptr + pair)
        # (e broadcast to the row vector first: Triton's CPU interpreter mishandles a scalar & a tensor of bools)
        mask = ((offs_n < N) & (e + 0 * offs_n >= 0))[:, None] & (offs_k >= 0)[None, :]
        if not EVEN_K:
            mask = mask & ((k0 + offs_k) < K)[None, :]
        g_ptrs = (w_ptr + tl.maximum(e, 0).to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
                  + k0 + offs_k[None, :])
        x_ptrs = a_ptr + (pair // a_row_div).to(tl.int64) * stride_am + k0 + offs_k[None, :] + 0 * offs_n[:, None]
        return g_ptrs, g_ptrs + N * stride_wn, x_ptrs, mask

    @triton.jit
    def _moe_gemv_persistent_kernel(a_ptr, w_ptr, s_ptr, out_ptr, ids_ptr, num_items, N, K, a_row_div, stride_am,
                                    stride_we, stride_wn, stride_se, stride_om, HAS_SCALE: tl.constexpr,
                                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                                    FP8: tl.constexpr = False, INT8: tl.constexpr = False, PDL: tl.constexpr = 0):
        """``_moe_gemv_kernel``'s work (item = (pair, N tile), h[pair, n-tile] = SiLU(gate) * up) on a persistent
        grid: program p takes items p, p + P, p + 2P, ... as ONE stream of (item, K tile) tiles, the next tile
        always in flight, across item boundaries too. One program per item starts each item's stream from
        nothing (a DRAM latency per item, and a grid tail); here a program pays that latency once. Same loads,
        products and fp32 sums per item as ``_moe_gemv_kernel``, so the two give identical outputs.

        PDL: as ``_moe_gemv_kernel`` (the expert ids come from the router, so the wait comes first)."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        n_tiles = tl.cdiv(N, BLOCK_N)
        nk = tl.cdiv(K, BLOCK_K)
        steps = tl.cdiv(num_items - pid, nprog) * nk
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        g_ptrs, u_ptrs, x_ptrs, mask = _gate_up_tile(0, nk, pid, nprog, n_tiles, offs_n0, offs_k, ids_ptr, a_ptr,
                                                     w_ptr, N, K, a_row_div, stride_am, stride_we, stride_wn,
                                                     BLOCK_N, BLOCK_K, EVEN_K)
        g_next = tl.load(g_ptrs, mask=mask, other=0)
        u_next = tl.load(u_ptrs, mask=mask, other=0)
        x_next = tl.load(x_ptrs, mask=mask, other=0.0)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for t in range(0, steps):
            g = g_next
            u = u_next
            x = x_next.to(tl.float32)
            # Prefetch tile t + 1, possibly the next item's (the last iteration re-reads its own tile).
            g_ptrs, u_ptrs, x_ptrs, mask = _gate_up_tile(tl.minimum(t + 1, steps - 1), nk, pid, nprog, n_tiles,
                                                         offs_n0, offs_k, ids_ptr, a_ptr, w_ptr, N, K, a_row_div,
                                                         stride_am, stride_we, stride_wn, BLOCK_N, BLOCK_K, EVEN_K)
            g_next = tl.load(g_ptrs, mask=mask, other=0)
            u_next = tl.load(u_ptrs, mask=mask, other=0)
            x_next = tl.load(x_ptrs, mask=mask, other=0.0)
            acc += x * _codes_f32(g, FP8, INT8)
            acc_u += x * _codes_f32(u, FP8, INT8)
            if t % nk == nk - 1:  # the item's last K tile: its epilogue, then a fresh accumulator
                item = pid + (t // nk) * nprog
                pair = item // n_tiles
                offs_n = (item % n_tiles) * BLOCK_N + offs_n0
                e = tl.load(ids_ptr + pair)
                mask_n = (offs_n < N) & (e + 0 * offs_n >= 0)
                out = tl.sum(acc, axis=1)
                up = tl.sum(acc_u, axis=1)
                if HAS_SCALE:
                    s_base = s_ptr + tl.maximum(e, 0).to(tl.int64) * stride_se
                    out = out * tl.load(s_base + offs_n, mask=mask_n, other=0.0)
                    up = up * tl.load(s_base + N + offs_n, mask=mask_n, other=0.0)
                out = out * tl.sigmoid(out) * up
                tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, out.to(out_ptr.dtype.element_ty),
                         mask=mask_n)
                acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
                acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)

    @triton.jit
    def _down_tile(t, nk, tok, offs_s, offs_k, mask_n, w_rows, h_cols, w_ptr, h_ptr, ids_ptr, K, stride_we, stride_hm,
                   TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        # Pointers and masks of tile t of _moe_down_sum_kernel (slot group t // nk, K tile t % nk), [SLOTS, BN, BK]:
        # slots past TOP_K and pairs routed to another rank (id -1) read neither weights nor their h row (the
        # gate_up kernel left that row unwritten: it may hold NaN).
        g = t // nk
        k0 = (t - g * nk) * BLOCK_K
        slot = g * SLOTS + offs_s
        e = tl.load(ids_ptr + tok * TOP_K + slot, mask=slot < TOP_K, other=-1)  # [SLOTS]
        w_mask = (e >= 0)[:, None, None] & mask_n[None, :, None]
        h_mask = (e >= 0)[:, None, None] & (h_cols >= 0)
        if not EVEN_K:
            kin = ((k0 + offs_k) < K)[None, None, :]
            w_mask = w_mask & kin
            h_mask = h_mask & kin
        w_ptrs = w_ptr + tl.maximum(e, 0).to(tl.int64)[:, None, None] * stride_we + k0 + w_rows
        h_ptrs = h_ptr + (tok * TOP_K + slot)[:, None, None] * stride_hm + k0 + h_cols
        return w_ptrs, w_mask, h_ptrs, h_mask

    @triton.jit
    def _moe_down_sum_kernel(h_ptr, w_ptr, s_ptr, out_ptr, tw_ptr, ids_ptr, N, K, stride_hm, stride_we,
                             stride_wn, stride_se, stride_om, TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                             FP8: tl.constexpr = False, INT8: tl.constexpr = False, PDL: tl.constexpr = 0,
                             SLOTS: tl.constexpr = 1):
        """The small-M down projection with the routing-weight multiply and the top-k sum folded in: program
        (token, N tile) streams rows [n-tile] of the token's TOP_K experts, SLOTS experts at a time as one
        [SLOTS, BLOCK_N, BLOCK_K] tile, one (slot group, K tile) after another in a single loop (the next tile,
        possibly the next slot group's, is always in flight), and writes
        out[token, n-tile] = sum_j topk_weights[token, j] * (w2[e_j] @ h[token * TOP_K + j])[n-tile] once.

        SLOTS (a power of two; slots past TOP_K are masked): 1 walks the experts one after another, a chain of
        TOP_K * cdiv(K, BLOCK_K) dependent tiles; SLOTS = TOP_K puts every expert's tile in flight at once, a
        chain of cdiv(K, BLOCK_K) (Qwen3-30B-A3B: 8 experts of K = 768, so 24 -> 3 tiles at BLOCK_K 256).

        The weight and the expert's channel scale multiply each slot's products before they join the fp32
        accumulator, so the sum over slots and K is one accumulation, rounded to the output dtype once. A pair
        routed to another rank (id -1) reads nothing, neither weights nor its h row (which the gate_up kernel
        left unwritten: it may hold NaN), and adds 0.

        PDL: the expert ids were written before the gate_up kernel started (by the router), so the first weight
        tile is loaded before the wait; h (the gate_up kernel's output) only after it."""
        tok = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        offs_s = tl.arange(0, SLOTS)
        w_rows = offs_n[None, :, None].to(tl.int64) * stride_wn + offs_k[None, None, :]  # [1, BN, BK]
        h_cols = offs_k[None, None, :] + 0 * offs_n[None, :, None]  # h through the weight tile's layout
        nk = tl.cdiv(K, BLOCK_K)
        GROUPS: tl.constexpr = (TOP_K + SLOTS - 1) // SLOTS
        steps = GROUPS * nk
        # tile 0 (slot group 0, K offset 0): its weights before the PDL wait, its h rows after
        w_ptrs, w_mask, h_ptrs, h_mask = _down_tile(0, nk, tok, offs_s, offs_k, mask_n, w_rows, h_cols, w_ptr, h_ptr,
                                                    ids_ptr, K, stride_we, stride_hm, TOP_K, SLOTS, BLOCK_K, EVEN_K)
        w_next = tl.load(w_ptrs, mask=w_mask, other=0)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        h_next = tl.load(h_ptrs, mask=h_mask, other=0.0)
        acc = tl.zeros([SLOTS, BLOCK_N, BLOCK_K], tl.float32)
        for t in range(0, steps):
            slot = (t // nk) * SLOTS + offs_s
            smask = slot < TOP_K
            pair = tok * TOP_K + slot
            e = tl.load(ids_ptr + pair, mask=smask, other=-1)
            # each slot's multiplier: the routing weight (0 for another rank's expert) times the channel scale
            mult = tl.where(e >= 0, tl.load(tw_ptr + pair, mask=smask, other=0.0), 0.0)[:, None] \
                + tl.zeros([SLOTS, BLOCK_N], tl.float32)
            if HAS_SCALE:
                mult = mult * tl.load(s_ptr + tl.maximum(e, 0).to(tl.int64)[:, None] * stride_se + offs_n[None, :],
                                      mask=mask_n[None, :], other=0.0)
            w = w_next
            hx = h_next.to(tl.float32)
            # Prefetch tile t + 1 (the last iteration re-reads its own tile, an L1/L2 hit).
            w_ptrs, w_mask, h_ptrs, h_mask = _down_tile(tl.minimum(t + 1, steps - 1), nk, tok, offs_s, offs_k, mask_n,
                                                        w_rows, h_cols, w_ptr, h_ptr, ids_ptr, K, stride_we,
                                                        stride_hm, TOP_K, SLOTS, BLOCK_K, EVEN_K)
            h_next = tl.load(h_ptrs, mask=h_mask, other=0.0)
            w_next = tl.load(w_ptrs, mask=w_mask, other=0)
            acc += (hx * _codes_f32(w, FP8, INT8)) * mult[:, :, None]
        out = tl.sum(tl.sum(acc, axis=2), axis=0)
        tl.store(out_ptr + tok * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)


    @triton.jit
    def _down_item(t, spi, pid, nprog, n_tiles, offs_n0, offs_k, stride_wn, N, BLOCK_N: tl.constexpr):
        # A persistent down program's tile t: its item (token, N tile) = pid + (t // spi) * nprog, the tile's
        # index within the item, and the item's row vectors as _moe_down_sum_kernel computes them.
        item = pid + (t // spi) * nprog
        tok = (item // n_tiles).to(tl.int64)
        offs_n = (item % n_tiles) * BLOCK_N + offs_n0
        w_rows = offs_n[None, :, None].to(tl.int64) * stride_wn + offs_k[None, None, :]  # [1, BN, BK]
        h_cols = offs_k[None, None, :] + 0 * offs_n[None, :, None]
        return t % spi, tok, offs_n, offs_n < N, w_rows, h_cols

    @triton.jit
    def _moe_down_sum_persistent_kernel(h_ptr, w_ptr, s_ptr, out_ptr, tw_ptr, ids_ptr, num_items, N, K, stride_hm,
                                        stride_we, stride_wn, stride_se, stride_om, TOP_K: tl.constexpr,
                                        HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                        EVEN_K: tl.constexpr, FP8: tl.constexpr = False, INT8: tl.constexpr = False,
                                        PDL: tl.constexpr = 0, SLOTS: tl.constexpr = 1):
        """``_moe_down_sum_kernel``'s work on a persistent grid: program p takes items (token, N tile) p, p + P,
        ... and runs their (slot group, K tile) tiles as one stream, the next tile in flight across item
        boundaries; each item's epilogue (the top-k sum, one store) follows its last tile. Same loads, products
        and fp32 sums per item as ``_moe_down_sum_kernel``, so the two give identical outputs.

        PDL: the first tile's weights before the wait, its h rows after (as ``_moe_down_sum_kernel``)."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        offs_s = tl.arange(0, SLOTS)
        n_tiles = tl.cdiv(N, BLOCK_N)
        nk = tl.cdiv(K, BLOCK_K)
        GROUPS: tl.constexpr = (TOP_K + SLOTS - 1) // SLOTS
        spi = GROUPS * nk  # tiles per item
        steps = tl.cdiv(num_items - pid, nprog) * spi
        tt, tok, offs_n, mask_n, w_rows, h_cols = _down_item(0, spi, pid, nprog, n_tiles, offs_n0, offs_k, stride_wn,
                                                             N, BLOCK_N)
        w_ptrs, w_mask, h_ptrs, h_mask = _down_tile(tt, nk, tok, offs_s, offs_k, mask_n, w_rows, h_cols, w_ptr, h_ptr,
                                                    ids_ptr, K, stride_we, stride_hm, TOP_K, SLOTS, BLOCK_K, EVEN_K)
        w_next = tl.load(w_ptrs, mask=w_mask, other=0)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        h_next = tl.load(h_ptrs, mask=h_mask, other=0.0)
        acc = tl.zeros([SLOTS, BLOCK_N, BLOCK_K], tl.float32)
        for t in range(0, steps):
            tt, tok, offs_n, mask_n, w_rows, h_cols = _down_item(t, spi, pid, nprog, n_tiles, offs_n0, offs_k,
                                                                 stride_wn, N, BLOCK_N)
            slot = (tt // nk) * SLOTS + offs_s
            smask = slot < TOP_K
            pair = tok * TOP_K + slot
            e = tl.load(ids_ptr + pair, mask=smask, other=-1)
            mult = tl.where(e >= 0, tl.load(tw_ptr + pair, mask=smask, other=0.0), 0.0)[:, None] \
                + tl.zeros([SLOTS, BLOCK_N], tl.float32)
            if HAS_SCALE:
                mult = mult * tl.load(s_ptr + tl.maximum(e, 0).to(tl.int64)[:, None] * stride_se + offs_n[None, :],
                                      mask=mask_n[None, :], other=0.0)
            w = w_next
            hx = h_next.to(tl.float32)
            # Prefetch tile t + 1, possibly the next item's (the last iteration re-reads its own tile).
            t1, tok1, offs_n1, mask_n1, w_rows1, h_cols1 = _down_item(tl.minimum(t + 1, steps - 1), spi, pid, nprog,
                                                                      n_tiles, offs_n0, offs_k, stride_wn, N, BLOCK_N)
            w_ptrs, w_mask, h_ptrs, h_mask = _down_tile(t1, nk, tok1, offs_s, offs_k, mask_n1, w_rows1, h_cols1,
                                                        w_ptr, h_ptr, ids_ptr, K, stride_we, stride_hm, TOP_K, SLOTS,
                                                        BLOCK_K, EVEN_K)
            h_next = tl.load(h_ptrs, mask=h_mask, other=0.0)
            w_next = tl.load(w_ptrs, mask=w_mask, other=0)
            acc += (hx * _codes_f32(w, FP8, INT8)) * mult[:, :, None]
            if tt == spi - 1:  # the item's last tile: the top-k sum, one store, a fresh accumulator
                out = tl.sum(tl.sum(acc, axis=2), axis=0)
                tl.store(out_ptr + tok * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)
                acc = tl.zeros([SLOTS, BLOCK_N, BLOCK_K], tl.float32)

def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                torch.int8: "int8", torch.float8_e4m3fn: "fp8"}


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
              small_m: bool | None = None, config: MoeConfig | None = None) -> torch.Tensor:
    """The routed experts of one MoE layer (see the module docstring); same contract as ``ref_fused_moe``.

    Args:
        x: [T, H] fp16/bf16/fp32, contiguous. w13 [E, 2I, H], w2 [E, H, I]: x's dtype, or int8 / float8_e4m3fn
            with ``w13_scale`` [E, 2I] / ``w2_scale`` [E, H] float32. topk_weights [T, k] float; topk_ids [T, k]
            int (local ids, -1: another rank's expert).
        small_m: force the GEMV path (True) or the grouped path (False), each with its default tiles; None: as
            ``config`` says.
        config: the launch config (``fused_moe_config.MoeConfig``); None: the measured table's entry for this
            shape, format and the nearest measured M on this device, else the heuristic by M.
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
    if config is None:
        if small_m is not None:
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
            config = default_config(1 if small_m else max(num_tokens, 5), num_experts, top_k, inter, hidden,
                                    w13.dtype in (torch.int8, torch.float8_e4m3fn), sms)
        else:
            config = get_config(num_tokens, num_experts, top_k, inter, hidden, _DTYPE_NAMES.get(w13.dtype, "?"),
                                x.device)
    if config.path == "loop":
        if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return ref_fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
        config = config.fused_config or default_config(num_tokens, num_experts, top_k, inter, hidden,
                                                       w13_scale is not None, 1)
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    has_scale = w13_scale is not None
    s13 = w13_scale if has_scale else tw  # a dummy pointer when unused
    s2 = w2_scale if has_scale else tw
    fp8 = w13.dtype == torch.float8_e4m3fn
    int8 = w13.dtype == torch.int8
    if fp8:  # the kernels read E4M3 codes as bytes and bitcast them (see _codes)
        w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    c = config
    if c.path == "gemv":
        ids = topk_ids.reshape(-1).contiguous()  # int64 or int32, read as is (no cast kernel)
        pdl = {"PDL": 1, "launch_pdl": True} if pdl_mode(x.device) else {}
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        items = num_pairs * triton.cdiv(inter, c.block_n)
        if c.persistent:  # a grid of c.persistent programs per SM, each a stream over many items
            _moe_gemv_persistent_kernel[(min(items, c.persistent * sms),)](
                x, w13, s13, h, ids, items, inter, hidden, top_k, x.stride(0), w13.stride(0), w13.stride(1),
                s13.stride(0) if has_scale else 0, h.stride(0), HAS_SCALE=has_scale, BLOCK_N=c.block_n,
                BLOCK_K=c.block_k, EVEN_K=hidden % c.block_k == 0, FP8=fp8, INT8=int8, num_warps=c.num_warps,
                num_stages=1, **pdl)
        else:
            _moe_gemv_kernel[(num_pairs, triton.cdiv(inter, c.block_n))](
                x, w13, s13, h, ids, inter, hidden, top_k, x.stride(0), w13.stride(0), w13.stride(1),
                s13.stride(0) if has_scale else 0, h.stride(0), HAS_SCALE=has_scale, BLOCK_N=c.block_n,
                BLOCK_K=c.block_k, EVEN_K=hidden % c.block_k == 0, FP8=fp8, INT8=int8, num_warps=c.num_warps,
                num_stages=1, **pdl)
        # The down GEMV writes the top-k sum itself (no [T * k, H] buffer, no reduction launch).
        out = torch.empty_like(x)
        dn, dk, dw = c.down_tile()
        down = dict(TOP_K=top_k, HAS_SCALE=has_scale, BLOCK_N=dn, BLOCK_K=dk, EVEN_K=inter % dk == 0, FP8=fp8,
                    INT8=int8, SLOTS=min(c.down_slots, _next_pow2(top_k)), num_warps=dw, num_stages=1, **pdl)
        strides = (h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0) if has_scale else 0, out.stride(0))
        items = num_tokens * triton.cdiv(hidden, dn)
        if c.down_persistent:
            _moe_down_sum_persistent_kernel[(min(items, c.down_persistent * sms),)](
                h, w2, s2, out, tw, ids, items, hidden, inter, *strides, **down)
        else:
            _moe_down_sum_kernel[(num_tokens, triton.cdiv(hidden, dn))](
                h, w2, s2, out, tw, ids, hidden, inter, *strides, **down)
        return out
    # The grouped path never visits a pair routed to another rank (-1): its rows of out must start at 0. CPU:
    # checked (cheap); CUDA: zero-filled (no host sync).
    remote = None if x.is_cuda else bool((topk_ids < 0).any())
    out = (torch.zeros if remote is not False else torch.empty)(num_pairs, hidden, dtype=x.dtype, device=x.device)
    bm = c.block_m
    ieee = x.dtype == torch.float32
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, num_experts, bm)
    num_blocks = expert_ids.numel()
    _moe_gate_up_kernel[(num_blocks * triton.cdiv(inter, c.block_n),)](
        x, w13, s13, h, sorted_ids, expert_ids, num_post, num_pairs, num_blocks, top_k, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0) if has_scale else 0, h.stride(0),
        HAS_SCALE=has_scale, IEEE=ieee, BLOCK_M=bm, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
        FP8=fp8, num_warps=c.num_warps, num_stages=c.num_stages)
    _moe_down_kernel[(num_blocks * triton.cdiv(hidden, c.block_n),)](
        h, w2, s2, out, tw, sorted_ids, expert_ids, num_post, num_pairs, num_blocks, hidden, inter, h.stride(0),
        w2.stride(0), w2.stride(1), s2.stride(0) if has_scale else 0, out.stride(0), HAS_SCALE=has_scale,
        IEEE=ieee, BLOCK_M=bm, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, FP8=fp8,
        num_warps=c.num_warps, num_stages=c.num_stages)
    # The top-k sum over the k slots of each token in one fixed-order reduction (fp32 accumulation for 16-bit
    # dtypes, torch's reduction accumulator; rounded to x's dtype once).
    if top_k == 1:
        return out.view(num_tokens, hidden)  # one slot: the sum is the slot itself (no reduction launch)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
