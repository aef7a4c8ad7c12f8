"""Split-KV paged decode attention (Flash-Decoding; Dao, Haziza, Massa, Sizov 2023, PyTorch blog
"Flash-Decoding for long-context inference"), with a log-sum-exp reduction, in Triton.

Decode has one query per sequence, so parallelism over (sequence, head) alone leaves most of the GPU idle
at small batch. Each sequence's context is cut into ``num_splits`` chunks handled by separate programs:

  stage 1, grid (num_seqs, num_kv_heads, num_splits): one program streams its chunk of K and V for ONE
      kv head through the block table, and serves all ``group = H / H_kv`` query heads of that kv head at
      once (the [group, D] query tile is padded to 16 rows for tl.dot), so every KV byte is read once.
      It writes an unnormalised-by-others partial output o_s = softmax_s(q k^T) v ([D] fp32) and its
      log-sum-exp lse_s (base 2).
  stage 2, grid (num_seqs, H): out = sum_s 2^(lse_s - lse) o_s with lse = log2 sum_s 2^lse_s.

The "old" kernel runs stage 2 itself (``FUSED_REDUCE``): the last of a (sequence, kv head)'s split programs to
finish, counted by an atomic arrival counter, merges the partials, so a decode step's attention is one launch.

Bytes: 2 * seq_len * H_kv * (D * itemsize + scale bytes) per sequence (K and V once); q, out and the
fp32 partials are O(H * D * num_splits), negligible at long context. So the kernel is HBM-bound and its
figure of merit is achieved bandwidth on KV reads against the device's measured read bandwidth.

Quantized caches (formats in ``roofline.kernels.common``): int8 codes are read with their per-key float32
scales, the codes cast to q's dtype in registers, ``qk *= k_scale[None, :]`` after the QK dot and
``p * v_scale[None, :]`` before the PV dot (the softmax sum uses p itself); fp8 e4m3 codes use the
layer's per-head scales, folded into the softmax scale (K) and the split's output (V). No dequantized
copy of the cache is ever written.

Stage-1 variants (``variant=``; issue 29): "old" is the kernel above. The quantized-KV version of it ran at
0.42-0.64 of read bandwidth on the H200 (issue-bound: the same per-tile instructions as bf16 for half the
bytes, 4 programs per SM at 138 registers; bench/results/attention-20261201/ncu-decode-quant.txt).
"mma" and "fma" (``roofline.kernels.decode_attention_packed``) pack the GQA group's heads times the step's
query positions into the tile's rows (``query_len`` > 1: a speculative verify step reads each KV byte once
for all its positions), address a tile from one scalar base with constexpr strides, convert int8 codes
by a magic-number add and rescale the accumulator lazily; "fma" computes on CUDA cores (no tl.dot, no
padding to 16 rows). ``roofline bench attention --decode-only --variants old,mma,fma`` measures them
against each other and bf16 in one process; :data:`DEFAULT_VARIANT` records the choice per format.
"gluon" (``roofline.kernels.gluon_decode``, int8 / fp8 caches at query_len 1): a Gluon mma_v2 kernel
with the keys as the MMA's M (swap-AB), K's codes converted in registers straight into the operand; a call
that names no variant runs it where it is supported (``ROOFLINE_DECODE_KERNEL``: auto / triton / gluon),
else the Triton kernel with one log line per reason.

CUDA graphs: the kernels read seq_lens and block_tables only as device tensors; ``num_splits`` is a launch
constant. A captured graph therefore fixes num_splits; :func:`choose_num_splits` picks it from static
quantities (batch, kv heads, the block table's width = the longest context the graph can see, the page
size, SM count),
and each split's length is derived in-kernel from the sequence's actual length (empty splits write
lse = -inf and drop out of the reduction).

PDL (``roofline.kernels.pdl``): the "old" stage-1 kernel and the reduction are launched with programmatic
dependent launch where the GPU has it, so that, inside a decode step's graph, each may start while the kernel
before it drains (the split kernel waits before reading q and the cache, the reduction before reading the
partials) and the next kernel (o_proj, which streams its weights before its own wait) starts early.
"""

from __future__ import annotations

import math

import torch

from roofline.kernels import pdl
from roofline.kernels.common import (
    KV_QUANT_NONE,
    KV_QUANT_PER_HEAD,
    KV_QUANT_PER_TOKEN,
    check_paged_attention_inputs,
    kv_quant_mode,
)
from roofline.kernels.decode_attention_packed import (
    MAX_PACKED_ROWS,
    VARIANTS,
    launch_packed_split,
    packed_rows,
)
from roofline.kernels.gluon_decode import (
    GLUON_BLOCK_N,
    GLUON_NUM_WARPS,
    decode_kernel_choice,
    gluon_config_reason,
    gluon_decode_unsupported_reason,
    launch_gluon_split,
    log_fallback_once,
)
from roofline.kernels.prefill_attention import ref_paged_attention
from roofline.kernels.splitk import arrival_counters

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def ref_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    compute_dtype: torch.dtype = torch.float32,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    query_len: int = 1,
) -> torch.Tensor:
    """Pure-torch twin: q [num_seqs * query_len, H, D]; sequence i's ``query_len`` queries are its last
    positions, seq_lens[i] - query_len + t for t < query_len, and query t sees keys 0..that position.

    The paged reference with ``query_len`` queries per sequence; computes in ``compute_dtype``, returns q's
    dtype. ``k_scale``/``v_scale``: the scales of an int8/fp8 cache (dequantized before attending).
    """
    num_seqs = seq_lens.shape[0]
    query_start_loc = torch.arange(num_seqs + 1, device=q.device) * query_len
    return ref_paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, compute_dtype,
                               k_scale, v_scale)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int = 132,
                      block_size: int = 16, block_n: int = 64, min_keys_per_split: int = 512,
                      max_splits: int = 64) -> int:
    """Splits per (sequence, kv head): a power of two near 4 programs per SM, in whole pages.

    Measured on the H200 (llama-3-8b shape, block_size 16; docs/kernels.md): batch 8 x 32k gives
    0.49/0.79/0.91/0.99/0.99 of read bandwidth at 2/4/5/8/16 splits, but 0.64 at 3 and 0.76 at 9 (odd
    counts are consistently slow, so only powers of two are used); batch 32 x 128k 1.07 at 2, 4, 8 or 16.
    Each split keeps >= ``min_keys_per_split`` keys while the grid has >= 1 program per SM.

    Page size (issue 29): batch 1 x 4k took 38-42 us at block_size 16/64 but 116-120 us at 128/256
    (bench/results/attention-blocksize-20261201.json), all at 8 splits of 512 keys: 64 programs on 132 SMs,
    each a serial chain of 8 tiles, so latency-bound. A split is cut at a page boundary once pages are
    at least a tile (:func:`split_align`), so it holds whole pages; and when the batch's (sequence, kv head)
    pairs fill less than the SMs, a split may shrink to ``max(2 tiles, 1 page)`` keys so that more, shorter
    chains run in parallel. The split count never exceeds the pages of ``max_context``.
    Depends only on static sizes (module docstring).

    Args:
        num_seqs, num_kv_heads: the batch's (sequence, kv head) pairs, one program row each.
        max_context: the longest context the launch can see (block-table width x block_size).
        num_sms: streaming multiprocessors of the device. block_size: the KV cache's page, in tokens.
        block_n: keys per tile of the kernel. min_keys_per_split, max_splits: bounds.

    Raises:
        ValueError: a block_size or block_n below 1 (names the value).
    """
    if block_size < 1 or block_n < 1:
        raise ValueError(f"block_size {block_size} and block_n {block_n} must be >= 1")

    def floor_pow2(n: int) -> int:
        return 1 << (max(1, n).bit_length() - 1)

    pairs = max(1, num_seqs * num_kv_heads)
    want = floor_pow2(math.ceil(4 * num_sms / pairs))
    align = split_align(block_size, block_n)
    min_keys = min_keys_per_split if pairs >= num_sms else max(2 * block_n, align)
    by_len = floor_pow2(max_context // max(min_keys, align))
    by_pages = floor_pow2(-(-max_context // block_size))
    return int(min(want, by_len, by_pages, max_splits))


# "fma" on a 1-byte cache (int8, fp8) with 8-key tiles gives wrong results under Triton 3.6 on the H200 (rel err
# 1.9 against the float64 oracle at 16 packed rows, D 128; 16- and 32-key tiles pass, and so does a 16-bit cache
# at 8: bench/results/kvq-fma-20261204). Such a tile is refused, and the default never picks it.
FMA_MIN_BLOCK_N_1BYTE = 16


def default_block_n(head_dim: int, variant: str, group: int = 4, query_len: int = 1, code_bytes: int = 2) -> int:
    """Keys per tile when the caller names none: 64 (32 past D 128). The CUDA-core "fma" tile holds a
    [rows, block_n, D] product, so its block_n keeps that at <= 16K elements (128 registers a thread at 4
    warps): 32 for 4 rows at D 128, 8 for 16 rows (16 on a 1-byte cache, ``code_bytes`` 1: see
    ``FMA_MIN_BLOCK_N_1BYTE``)."""
    if variant != "fma":
        return 64 if head_dim <= 128 else 32
    rows = packed_rows(group, query_len, use_dot=False)
    block_d = 1 << (head_dim - 1).bit_length()
    return max(FMA_MIN_BLOCK_N_1BYTE if code_bytes == 1 else 8, min(32, 16384 // (rows * block_d)))


def split_align(block_size: int, block_n: int) -> int:
    """Keys a split's length is rounded up to: whole pages when a page holds whole tiles, else whole tiles."""
    return block_size if block_size % block_n == 0 else block_n


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _decode_split_kernel(
        Q, KC, VC, KS, VS, BlockTables, SeqLens, MidO, MidLse, TreeLo, TreeBits, Out, Counters,
        scale_log2e,
        stride_qs, stride_qh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        stride_s_slot,  # int8 scales viewed as [num_slots, H_kv]: H_kv
        stride_bt,
        stride_ms, stride_mh, stride_msp,  # MidO [num_seqs, H, num_splits, D] (MidLse has no D dim)
        stride_ls, stride_lh,
        stride_os, stride_oh,  # Out [num_seqs, H, D] (FUSED only)
        GROUP: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_ALIGN: tl.constexpr,
        NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr, DOT_F16: tl.constexpr,
        PDL: tl.constexpr = 0, TREE: tl.constexpr = 0, FUSED: tl.constexpr = 0,
        GROUP_P2: tl.constexpr = 1, SPLITS_P2: tl.constexpr = 1, RED_SPLITS: tl.constexpr = 1,
    ):
        # TREE: the row is a speculative token-tree node (a decode row per node): keys at positions p >= TreeLo[row]
        # (the tree region) are seen only where bit p - TreeLo[row] of TreeBits[row] is set (its ancestors and
        # itself; -1: every key). A split or tile can then hold no visible key: the running max stays finite.
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        # seq_lens and block tables come from the host before the step; q and this step's K/V rows from the
        # previous kernel (RoPE + cache store), so PDL waits before those (roofline.kernels.pdl).
        seq_len = tl.load(SeqLens + seq)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        # Split length rounded to SPLIT_ALIGN keys (whole tiles, or whole pages when a page holds whole tiles),
        # so a split's tiles start BLOCK_N-aligned.
        split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), SPLIT_ALIGN) * SPLIT_ALIGN
        start = split * split_len
        end = tl.minimum(start + split_len, seq_len)

        offs_g = tl.arange(0, BLOCK_H)  # query heads of this kv head, padded to >= 16 rows for tl.dot
        heads = kv_head * GROUP + offs_g
        gmask = offs_g < GROUP
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < HEAD_DIM
        q = tl.load(Q + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
        if DOT_F16:  # bf16 q with a quantized cache: both dots in fp16 (codes exact, 3 more mantissa bits)
            q = q.to(tl.float16)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        bt_row = BlockTables + seq.to(tl.int64) * stride_bt
        k_base = KC + kv_head * stride_kh
        v_base = VC + kv_head * stride_vh
        if QUANT == 2:  # fp8: the layer's static per-head K scale joins the softmax scale
            scale_log2e = scale_log2e * tl.load(KS + kv_head)
        if TREE:
            tree_lo = tl.load(TreeLo + seq)
            tree_bits = tl.load(TreeBits + seq)
        for n in range(start, end, BLOCK_N):
            offs_n = n + tl.arange(0, BLOCK_N)
            nmask = offs_n < end
            if PAGE % BLOCK_N == 0:
                # The whole tile lies in one cache block: one block-table read, contiguous rows.
                page = tl.load(bt_row + n // PAGE).to(tl.int64)
            else:
                page = tl.load(bt_row + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)  # [BLOCK_N]
            k_row = page * stride_kb + (offs_n % PAGE) * stride_ks
            v_row = page * stride_vb + (offs_n % PAGE) * stride_vs
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(k_base + k_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_base + v_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            if QUANT != 0:
                k = k.to(q.dtype)  # int8 / e4m3 codes are exact in fp16, bf16 and fp32
                v = v.to(q.dtype)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e  # [BLOCK_H, BLOCK_N]
            if QUANT == 1:
                # Per-key scales, masked loads (a stale slot's scale may be NaN): 0 there, and qk -> -inf below.
                s_row = (page * PAGE + offs_n % PAGE) * stride_s_slot + kv_head
                ks = tl.load(KS + s_row, mask=nmask, other=0.0)
                vs = tl.load(VS + s_row, mask=nmask, other=0.0)
                qk = qk * ks[None, :]
            keep = nmask
            if TREE:
                rel = offs_n.to(tl.int64) - tree_lo
                keep = keep & ((rel < 0) | (((tree_bits >> tl.maximum(rel, 0)) & 1) != 0))
            qk = tl.where(keep[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_ref = m_new
            if TREE:  # a row may have seen no key yet (all masked so far): exp2 then gives 0, not NaN
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(qk - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if QUANT == 1:
                p = p * vs[None, :]  # the V scale rides on p; l_i above sums the unscaled p
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        # Empty split (start >= end): l_i = 0, m_i = -inf -> lse = -inf, o = 0; the reduction gives it weight 0.
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o = acc / safe_l[:, None]
        if QUANT == 2:  # fp8: the per-head V scale, once per split
            o = o * tl.load(VS + kv_head)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        hd_mask = gmask[:, None] & dmask[None, :]
        out_ptrs = Out + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        if FUSED and NUM_SPLITS == 1:  # the one split is the answer (seq_len 0: l_i = 0, o = 0, as the reduction)
            tl.store(out_ptrs, o.to(Out.dtype.element_ty), mask=hd_mask)
        else:
            mid_row = MidO + seq.to(tl.int64) * stride_ms + heads[:, None] * stride_mh + offs_d[None, :]
            lse_row = MidLse + seq.to(tl.int64) * stride_ls + heads * stride_lh
            tl.store(mid_row + split * stride_msp, o, mask=hd_mask)
            tl.store(lse_row + split, lse, mask=gmask)
            if FUSED:
                # Last arrival reduces (as splitk._splitk_epilogue): the (sequence, kv head)'s last split program
                # to count itself in merges all NUM_SPLITS partials with _decode_reduce_kernel's weights (its fp32
                # sum in another order), then re-arms the counter. .cg loads: the other programs' partials are in
                # L2, not our L1.
                tl.debug_barrier()
                pair = seq * tl.num_programs(1) + kv_head
                arrived = tl.atomic_add(Counters + pair, 1, sem="acq_rel", scope="gpu")
                if arrived == NUM_SPLITS - 1:
                    # All splits' loads at once (a serial loop over splits cost ~1.5% of a batch-1 step on the
                    # H100): lse as [GROUP_P2, SPLITS_P2], the partials in chunks of RED_SPLITS splits as
                    # [GROUP_P2, RED_SPLITS, BLOCK_D] (<= max(4K, GROUP_P2 x BLOCK_D) values: bounded registers at
                    # 64 splits).
                    offs_r = tl.arange(0, GROUP_P2)
                    rmask = offs_r < GROUP
                    rheads = kv_head * GROUP + offs_r
                    lse_rows = MidLse + seq.to(tl.int64) * stride_ls + rheads * stride_lh
                    offs_sp = tl.arange(0, SPLITS_P2)
                    lse_all = tl.load(lse_rows[:, None] + offs_sp[None, :],
                                      mask=rmask[:, None] & (offs_sp < NUM_SPLITS)[None, :], other=float("-inf"),
                                      cache_modifier=".cg")  # [GROUP_P2, SPLITS_P2]
                    m_all = tl.max(lse_all, axis=1)
                    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # seq_len 0: every split empty
                    den = tl.sum(tl.exp2(lse_all - m_all[:, None]), axis=1)  # empty splits weigh 0
                    mid_rows = MidO + seq.to(tl.int64) * stride_ms + rheads * stride_mh
                    offs_c = tl.arange(0, RED_SPLITS)
                    total = tl.zeros([GROUP_P2, BLOCK_D], tl.float32)
                    for c in tl.static_range(0, SPLITS_P2, RED_SPLITS):
                        cmask = rmask[:, None] & (c + offs_c < NUM_SPLITS)[None, :]  # [GROUP_P2, RED_SPLITS]
                        w = tl.exp2(tl.load(lse_rows[:, None] + c + offs_c[None, :], mask=cmask,
                                            other=float("-inf"), cache_modifier=".cg") - m_all[:, None])
                        part = tl.load(mid_rows[:, None, None] + (c + offs_c)[None, :, None] * stride_msp
                                       + offs_d[None, None, :], mask=cmask[:, :, None] & dmask[None, None, :],
                                       other=0.0, cache_modifier=".cg")  # [GROUP_P2, RED_SPLITS, BLOCK_D]
                        total += tl.sum(part * w[:, :, None], axis=1)
                    total = total / tl.where(den > 0, den, 1.0)[:, None]
                    tl.store(Out + seq.to(tl.int64) * stride_os + rheads[:, None] * stride_oh + offs_d[None, :],
                             total.to(Out.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])
                    tl.atomic_xchg(Counters + pair, 0)

    @triton.jit
    def _decode_reduce_kernel(
        MidO, MidLse, Out,
        stride_ms, stride_mh, stride_msp, stride_ls, stride_lh, stride_os, stride_oh,
        NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        PDL: tl.constexpr = 0,
    ):
        if PDL:  # the partials are the split kernel's output
            gdc_wait()
            gdc_launch_dependents()
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_P2)
        smask = offs_s < NUM_SPLITS
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < HEAD_DIM
        lse = tl.load(MidLse + seq * stride_ls + head * stride_lh + offs_s, mask=smask, other=float("-inf"))
        mx = tl.max(lse, axis=0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)  # seq_len 0 (a padded batch row): all splits empty
        w = tl.exp2(lse - mx)  # [SPLITS_P2], 0 for empty splits
        denom = tl.sum(w, axis=0)
        o = tl.load(MidO + seq * stride_ms + head * stride_mh + offs_s[:, None] * stride_msp + offs_d[None, :],
                    mask=smask[:, None] & dmask[None, :], other=0.0)  # [SPLITS_P2, BLOCK_D]
        out = tl.sum(o * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
        tl.store(Out + seq * stride_os + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=dmask)


LOG2E = 1.4426950408889634
# Stage-1 kernel per cache format when the caller names none (query_len 1), from the H200 A/B of 2026-12-04
# (``roofline bench attention --decode-only --kv-cache-dtype auto,int8,fp8_e4m3 --batches 8,64 --ctxs 4k,32k
# --variants old,mma,fma``, bench/results/kvdecode-20261204/): "mma" took 0.89-1.00x of "old"'s time on int8 and
# 0.97-1.00x on fp8 at every point; on bf16 it was 0.99-1.06x, so bf16 keeps "old". "fma" lost everywhere (2-13x).
DEFAULT_VARIANT = {KV_QUANT_NONE: "old", KV_QUANT_PER_TOKEN: "mma", KV_QUANT_PER_HEAD: "mma"}
# The "old" kernel merges its splits itself (the last split program of a (sequence, kv head) to finish reduces,
# ``_decode_split_kernel``'s FUSED), so a decode step's attention is one launch, not two; False: the separate
# ``_decode_reduce_kernel``, as the other variants always do. Read at launch (before graph capture); ``roofline
# bench decode --attention-reduce fused,kernel`` measures both.
FUSED_REDUCE = True
# Every stage-1 kernel ``variant`` names: the Triton ones and the Gluon one (int8/fp8 caches, query_len 1).
ALL_VARIANTS = (*VARIANTS, "gluon")
__all__ = ["ALL_VARIANTS", "MAX_PACKED_ROWS", "VARIANTS", "DEFAULT_VARIANT", "choose_num_splits", "default_block_n",
           "paged_decode_attention", "ref_decode_attention", "split_align"]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    variant: str | None = None,
    query_len: int = 1,
    int8_magic: bool = True,
    rescale_log2: float = 8.0,
    decode_kernel: str | None = None,
    tree_lo: torch.Tensor | None = None,
    tree_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of paged attention, split-KV.

    Args:
        q: [num_seqs * query_len, H, D] fp32/fp16/bf16 (already RoPE'd): ``query_len`` queries per
            sequence, its last positions seq_lens[i] - query_len + t (t < query_len), each seeing keys up
            to its own position (1 for plain decode, 1 + k for a speculative verify step).
        k_cache, v_cache: [num_blocks, block_size, H_kv, D], holding each sequence's first seq_lens[i]
            keys (this step's keys included) at the slots given by its block table. q's dtype, or int8 /
            float8_e4m3fn codes with ``k_scale``/``v_scale`` (float32; int8 [num_blocks, block_size, H_kv],
            fp8 [H_kv]; see ``roofline.kernels.common``).
        block_tables: [num_seqs, max_blocks] int32.
        seq_lens: [num_seqs] int32 context lengths (0 gives a zero output row: padding).
        scale: softmax scale, usually 1/sqrt(D).
        num_splits: KV chunks per (sequence, kv head); default :func:`choose_num_splits` from static sizes.
        out: optional [num_seqs * query_len, H, D] output in q's dtype.
        block_n, num_warps, num_stages: tile/launch tuning (benchmarks sweep them); num_warps None: 4, or
            ``GLUON_NUM_WARPS`` (1) for the Gluon kernel, whose default tile is ``GLUON_BLOCK_N`` (32) keys.
        variant: stage-1 kernel, one of ``VARIANTS`` (``roofline.kernels.decode_attention_packed``):
            "old" (the group's heads padded to 16 rows for tl.dot, query_len 1 only), "mma" (all
            query_len x group rows packed into the dot's M), "fma" (the packed rows on CUDA cores, tl.sum,
            no tl.dot), "gluon" (``roofline.kernels.gluon_decode``: int8/fp8 cache, query_len 1, swap-AB
            mma_v2). None: "gluon" where ``decode_kernel`` allows it and it supports the call (else one log line
            with the reason), else :data:`DEFAULT_VARIANT` (by cache format), "mma" when query_len > 1.
        int8_magic: packed variants: int8 codes converted by the magic-number add (else a plain cast).
        rescale_log2: packed variants: rescale the accumulator only when a row's max grows by more than
            2^rescale_log2 (0: every tile, as the "old" kernel does).
        decode_kernel: "auto", "triton" or "gluon" (``roofline.kernels.gluon_decode``); None reads
            ``ROOFLINE_DECODE_KERNEL`` (default "auto": gluon on sm_90). Only used when ``variant`` is None.
        tree_lo, tree_bits: optional [num_seqs] int64, together: each row is a node of a speculative token tree
            verified as a decode row (``roofline.attention.backend.tree_decode_rows``); keys at positions
            p >= tree_lo[i] are seen only where bit p - tree_lo[i] of tree_bits[i] is set (-1: all). The "old"
            kernel with query_len 1 (None picks it).

    Returns:
        [num_seqs * query_len, H, D] in q's dtype. Softmax and accumulation in fp32.

    Raises:
        ValueError: H not a multiple of H_kv, shapes disagree, scales that do not fit the cache dtype, an
            unknown variant, query_len < 1, "old" with query_len > 1, q rows not num_seqs * query_len,
            more than ``MAX_PACKED_ROWS`` packed rows, "gluon" on a call it does not support or with a tile
            ``gluon_config_reason`` rejects, "fma" with block_n < 16 on a 1-byte cache, or an unknown
            ``decode_kernel`` (each names the value and the allowed range).
        RuntimeError: triton missing.
    """
    if triton is None:
        raise RuntimeError("triton is not installed; use ref_decode_attention on this machine")
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_paged_attention_inputs(q, k_cache, v_cache)
    quant = kv_quant_mode(k_cache, k_scale, v_scale)
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if query_len < 1:
        raise ValueError(f"query_len {query_len} must be >= 1")
    if num_rows != num_seqs * query_len:
        raise ValueError(f"q has {num_rows} rows; expected num_seqs {num_seqs} x query_len {query_len}")
    tree = tree_lo is not None or tree_bits is not None
    if tree:
        if tree_lo is None or tree_bits is None or tree_lo.shape != (num_seqs,) or tree_bits.shape != (num_seqs,) \
                or tree_lo.dtype != torch.int64 or tree_bits.dtype != torch.int64:
            raise ValueError(f"tree_lo and tree_bits must both be [num_seqs={num_seqs}] int64; got "
                             f"{None if tree_lo is None else (tuple(tree_lo.shape), tree_lo.dtype)} and "
                             f"{None if tree_bits is None else (tuple(tree_bits.shape), tree_bits.dtype)}")
        if variant not in (None, "old") or query_len != 1:
            raise ValueError(f"a tree mask runs in decode variant 'old' with query_len 1; got variant {variant!r}, "
                             f"query_len {query_len}")
        variant = "old"
    if variant is None and quant != KV_QUANT_NONE and query_len == 1:
        reason = gluon_decode_unsupported_reason(q, k_cache, v_cache, quant, query_len,
                                                 decode_kernel_choice(decode_kernel))
        if reason is None:
            reason = gluon_config_reason(block_n or GLUON_BLOCK_N, num_warps or GLUON_NUM_WARPS, head_dim)
        if reason is None:
            variant = "gluon"
        else:
            log_fallback_once(reason)
    if variant is None:
        variant = DEFAULT_VARIANT[quant] if query_len == 1 else "mma"
    if variant not in ALL_VARIANTS:
        raise ValueError(f"unknown decode variant {variant!r}; known: {', '.join(ALL_VARIANTS)}")
    if num_warps is None:
        num_warps = GLUON_NUM_WARPS if variant == "gluon" else 4
    if variant == "gluon":
        reason = gluon_decode_unsupported_reason(q, k_cache, v_cache, quant, query_len, "gluon")
        if reason is not None:
            raise ValueError(f"decode variant 'gluon' cannot run this call: {reason}")
        block_n = block_n or GLUON_BLOCK_N
        reason = gluon_config_reason(block_n, num_warps, head_dim)
        if reason is not None:
            raise ValueError(f"decode variant 'gluon': {reason}")
    if variant == "old" and query_len != 1:
        raise ValueError(f"decode variant 'old' takes query_len 1, got {query_len}; use 'mma' or 'fma'")
    if variant in ("mma", "fma"):
        packed_rows(group, query_len, variant == "mma")  # raises past MAX_PACKED_ROWS
    if block_n is None:
        block_n = default_block_n(head_dim, variant, group, query_len, k_cache.element_size())
    elif variant == "fma" and k_cache.element_size() == 1 and block_n < FMA_MIN_BLOCK_N_1BYTE:
        raise ValueError(f"decode variant 'fma' on a 1-byte ({k_cache.dtype}) cache needs block_n >= "
                         f"{FMA_MIN_BLOCK_N_1BYTE} (8-key tiles are wrong under Triton 3.6), got {block_n}")
    if num_splits is None:
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        if variant == "gluon":  # the split count targets warps per SM: programs of fewer warps get more splits
            num_sms *= max(1, 4 // num_warps)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, block_tables.shape[1] * block_size, num_sms=num_sms,
                                       block_size=block_size, block_n=block_n)
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    fused = variant == "old" and FUSED_REDUCE
    # fused with one split: the split kernel writes out directly, no partials
    mid_shape = (num_rows, num_heads, 0 if fused and num_splits == 1 else num_splits)
    mid_o = torch.empty((*mid_shape, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(mid_shape, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    per_token_stride = num_kv_heads if quant == KV_QUANT_PER_TOKEN else 0
    align = split_align(block_size, block_n)
    group_p2, splits_p2 = triton.next_power_of_2(group), triton.next_power_of_2(num_splits)
    if variant == "old":
        _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
            q, k_cache, v_cache,
            k_scale if k_scale is not None else q, v_scale if v_scale is not None else q,  # unused unless quantized
            block_tables, seq_lens, mid_o, mid_lse,
            tree_lo if tree else seq_lens, tree_bits if tree else seq_lens,  # unused unless TREE
            out, arrival_counters(q.device, num_seqs * num_kv_heads) if fused else seq_lens,  # unused unless FUSED
            scale * LOG2E,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            per_token_stride,
            block_tables.stride(0),
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
            mid_lse.stride(0), mid_lse.stride(1),
            out.stride(0), out.stride(1),
            GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), PAGE=block_size,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, SPLIT_ALIGN=align, NUM_SPLITS=num_splits,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", QUANT=quant,
            # H200, batch 8 x 32k / 64 x 4k (bench/results/attention-20261201/decode-quant-*.json): fp8 codes ->
            # fp16 (one packed cvt on sm_90) with fp16 dots runs 1.15-1.23x bf16 KV, codes -> bf16 0.94-1.15x.
            DOT_F16=bool(quant) and q.dtype == torch.bfloat16, TREE=int(tree), FUSED=int(fused),
            GROUP_P2=group_p2, SPLITS_P2=splits_p2,
            RED_SPLITS=min(splits_p2, max(1, 4096 // (group_p2 * block_d))),  # <= 4K values a chunk (or 1 split)
            num_warps=num_warps, num_stages=num_stages, **pdl.launch_kwargs(q.device),
        )
        if fused:
            return out
    elif variant == "gluon":
        launch_gluon_split(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, mid_o, mid_lse,
                           scale * LOG2E, quant, per_token_stride, num_splits, align, block_n, num_warps,
                           prefetch=num_stages >= 2)
    else:
        launch_packed_split(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, mid_o, mid_lse,
                            scale * LOG2E, quant, per_token_stride, query_len, num_splits, block_n, align,
                            use_dot=variant == "mma", int8_magic=int8_magic, rescale_log2=rescale_log2,
                            num_warps=num_warps, num_stages=num_stages)
    _decode_reduce_kernel[(num_rows, num_heads)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, SPLITS_P2=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim, BLOCK_D=block_d, num_warps=4, **pdl.launch_kwargs(q.device),
    )
    return out
