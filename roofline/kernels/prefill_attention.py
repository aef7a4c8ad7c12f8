"""Varlen paged prefill/extend attention in Triton: FlashAttention's tiled online softmax
(Dao et al. 2022, "FlashAttention"; Dao 2023, "FlashAttention-2") over the paged KV cache.

Each sequence i contributes q_len_i new query rows (query_start_loc) and has seq_len_i keys in the cache
(its cached prefix plus the new tokens, already written). Query j of the chunk sits at absolute position
ctx_i + j with ctx_i = seq_len_i - q_len_i and attends to keys 0..ctx_i + j. One rule serves full prefill
(ctx = 0), chunked prefill, prefix-cache hits and speculative verification.

Grid (cdiv(max_query_len, BLOCK_M), num_seqs, H): one program owns BLOCK_M query rows of one head and
streams that head's kv head through the block table in BLOCK_N-key tiles, keeping the running max m,
the running sum l and the [BLOCK_M, D] fp32 accumulator in registers; nothing of size S x S touches HBM.
The key range splits in two loops, as in FlashAttention-2: keys every row of the tile may see
(< ctx + m0 + 1) run without a mask, and the diagonal band runs with the causal mask. M-tiles are
issued last-first so the longest (most keys) programs start first and the tail is short.

FLOPs: 4 * sum_i q_len_i * (ctx_i + (q_len_i + 1) / 2) * H * D (2 GEMMs, causal half of the chunk).

Quantized caches (``QUANT``; formats in ``roofline.kernels.common``): the int8/e4m3 tile is cast to q's
dtype in registers; int8's per-key scales multiply qk after the QK dot and p before the PV dot (the row
sum l uses the unscaled p); fp8's per-head scales fold into the softmax scale (K) and the output (V).
The TMA path loads the code tiles with tensor descriptors as for 16-bit caches (1-byte elements, the same
[num_slots, H_kv * D] view) and the int8 scales with pointer loads.

Tree mask (speculative tree verification; issue 29): ``tree_mask`` [num_seqs, W] int64, W <= 64
(``MAX_TREE_ROWS``). For sequence i the last r = min(q_len_i, W) query rows and the last r keys (the
same tokens: this step's, already in the cache) form the tree region, nodes in topological order
(a parent before its children). Region row j sees every key before the region (the cached prefix and
earlier rows of the chunk, causally as usual) and region key a iff a <= j and bit a of
``tree_mask[i, j]`` is set: its ancestors, itself included (its own bit must be set, or a row with no
prefix sees nothing). Rows before the region are plain causal; a row of -1 (every bit) is plain causal,
so an all -1 mask equals no mask. Columns j >= r are ignored. In the kernel the tree keys go through
the masked (diagonal) loop, with the bit test added to the causal test; rows before a row's first
visible key in a tile keep a -inf max and contribute p = 0.
"""

from __future__ import annotations

import torch

from roofline.kernels.common import (
    KV_QUANT_PER_TOKEN,
    PagedBatch,
    check_paged_attention_inputs,
    kv_quant_mode,
    ref_dequantize,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

LOG2E = 1.4426950408889634
MAX_TREE_ROWS = 64  # query rows a tree mask covers per request: one int64 ancestor bitmask per row


def ref_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    compute_dtype: torch.dtype = torch.float32,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact paged causal attention in plain torch: the one reference every attention kernel is checked against.

    Args:
        q: [num_tokens, H, D], rows of sequence i at query_start_loc[i]:query_start_loc[i+1].
        k_cache, v_cache: [num_blocks, block_size, H_kv, D], holding each sequence's seq_lens[i] keys.
        query_start_loc: [num_seqs + 1] int; seq_lens: [num_seqs] int; block_tables: [num_seqs, W] int.
        scale: softmax scale. compute_dtype: fp32, or fp64 for a tighter reference.
        k_scale, v_scale: scales of an int8 ([num_blocks, block_size, H_kv]) or fp8 ([H_kv]) cache; the
            sequence's keys are dequantized (``ref_dequantize``) before attending.
        tree_mask: optional [num_seqs, W <= 64] int64 ancestor bitmasks (module docstring, "Tree mask").

    Returns:
        [num_tokens, H, D] in q's dtype. Query j of a chunk of q_len sits at position seq_len - q_len + j
        and sees keys 0..seq_len - q_len + j. A sequence with seq_len 0 (padding) gets zeros.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    quant = kv_quant_mode(k_cache, k_scale, v_scale)
    tree_rows = check_tree_mask(tree_mask, seq_lens.shape[0])
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, q_len = starts[i], starts[i + 1] - starts[i]
        if q_len == 0 or seq_len == 0:
            continue
        nb = (seq_len + block_size - 1) // block_size
        blocks = block_tables[i, :nb].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        ks, vs = k_scale, v_scale
        if quant == KV_QUANT_PER_TOKEN:
            assert k_scale is not None and v_scale is not None
            ks = k_scale[blocks].reshape(-1, num_kv_heads)[:seq_len]
            vs = v_scale[blocks].reshape(-1, num_kv_heads)[:seq_len]
        k = ref_dequantize(k, ks, compute_dtype)
        v = ref_dequantize(v, vs, compute_dtype)
        k = k.repeat_interleave(group, dim=1)  # [seq_len, H, D]
        v = v.repeat_interleave(group, dim=1)
        qi = q[start:start + q_len].to(compute_dtype)
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale  # [H, q_len, seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        hidden = k_pos[None, :] > q_pos[:, None]  # [q_len, seq_len]
        if tree_mask is not None:
            r = min(q_len, tree_rows)  # the last r rows and keys form the tree region
            bits = tree_mask[i, :r].to(q.device)  # [r] int64, row j's ancestors
            rel = torch.arange(r, device=q.device)
            in_tree = ((bits[:, None] >> rel[None, :]) & 1) != 0  # [r, r]: key a visible to row j
            hidden[q_len - r:, seq_len - r:] |= ~in_tree
        scores.masked_fill_(hidden[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def ref_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedBatch, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch twin of :func:`paged_prefill_attention` (same arguments)."""
    return ref_paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
                               k_scale=k_scale, v_scale=v_scale, tree_mask=tree_mask)


def check_tree_mask(tree_mask: torch.Tensor | None, num_seqs: int) -> int:
    """The tree region's row count W of a [num_seqs, W] int64 ``tree_mask`` (MAX_TREE_ROWS when None).

    Raises:
        ValueError: not int64, not 2-D with num_seqs rows, W of 0 or above ``MAX_TREE_ROWS`` (names the limit),
            or a last dim that is not contiguous.
    """
    if tree_mask is None:
        return MAX_TREE_ROWS
    if tree_mask.dtype != torch.int64 or tree_mask.dim() != 2 or tree_mask.shape[0] != num_seqs:
        raise ValueError(f"tree_mask must be int64 [num_seqs={num_seqs}, <= {MAX_TREE_ROWS}], got "
                         f"{tree_mask.dtype} {tuple(tree_mask.shape)}")
    width = tree_mask.shape[1]
    if not 1 <= width <= MAX_TREE_ROWS:
        raise ValueError(f"tree_mask covers {width} query rows per request; the limit is {MAX_TREE_ROWS} "
                         f"(one int64 ancestor bitmask per row)")
    if tree_mask.stride(1) != 1:
        raise ValueError("tree_mask needs a contiguous last dim")
    return width


if triton is not None:

    @triton.jit
    def _attend_tile(
        acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, kv_col, bt_row, start_n, offs_m_pos, seq_len,
        scale_log2e, stride_kb, stride_ks, stride_vb, stride_vs, offs_d, dmask,
        ks_base, vs_base, stride_s_slot, tree_bits, tree_start,
        MASKED: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
        QUANT: tl.constexpr, TREE: tl.constexpr,
    ):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        nmask = offs_n < seq_len
        if USE_TMA:
            # PAGE % BLOCK_N == 0: the tile is BLOCK_N consecutive rows of one block -> one bulk tensor copy
            # (cp.async.bulk.tensor) per operand, over the cache viewed as [num_slots, H_kv * D].
            page = tl.load(bt_row + start_n // PAGE)
            row = page * PAGE + start_n % PAGE
            kt = k_desc.load([row, kv_col]).T  # [BLOCK_D, BLOCK_N]
            s_rows = (row + tl.arange(0, BLOCK_N)).to(tl.int64) * stride_s_slot  # int8 scales of these slots
        else:
            if PAGE % BLOCK_N == 0:
                # The whole tile lies inside one cache block: one block-table read, strided rows.
                page = tl.load(bt_row + start_n // PAGE).to(tl.int64)
            elif MASKED:
                page = tl.load(bt_row + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)
            else:
                page = tl.load(bt_row + offs_n // PAGE).to(tl.int64)  # [BLOCK_N] one entry per key
            k_rows = page * stride_kb + (offs_n % PAGE) * stride_ks
            v_rows = page * stride_vb + (offs_n % PAGE) * stride_vs
            s_rows = (page * PAGE + offs_n % PAGE) * stride_s_slot
            # K^T tile [BLOCK_D, BLOCK_N] (loaded transposed so the dot needs no register shuffle)
            kt_ptrs = k_base + k_rows[None, :] + offs_d[:, None]
            v_ptrs = v_base + v_rows[:, None] + offs_d[None, :]
            if MASKED:
                kt = tl.load(kt_ptrs, mask=nmask[None, :] & dmask[:, None], other=0.0)
            elif BLOCK_D != HEAD_DIM:
                kt = tl.load(kt_ptrs, mask=dmask[:, None], other=0.0)
            else:
                kt = tl.load(kt_ptrs)
        if QUANT != 0:
            kt = kt.to(q.dtype)  # int8 / e4m3 codes are exact in fp16, bf16 and fp32
        # Scores in log2 units: scale*log2(e) is applied in fp32 after the dot (exact q operands), fused
        # with the max subtraction into one FMA, and the softmax uses exp2 (one MUFU op) instead of exp.
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if QUANT == 1:
            # Per-key int8 scales; a stale slot's scale may be NaN: masked tiles load 0 there (qk -> -inf below).
            if MASKED:
                ks = tl.load(ks_base + s_rows, mask=nmask, other=0.0)
                vs = tl.load(vs_base + s_rows, mask=nmask, other=0.0)
            else:
                ks = tl.load(ks_base + s_rows)
                vs = tl.load(vs_base + s_rows)
            qk = qk * ks[None, :]
        if MASKED:
            causal = (offs_n[None, :] <= offs_m_pos[:, None]) & nmask[None, :]
            if TREE:
                # Tree rows see a tree key only if its bit is set in the row's ancestor mask (module docstring).
                rel = offs_n - tree_start  # [BLOCK_N] key index inside the tree region (< 0: the prefix)
                bit = (tree_bits[:, None] >> tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)[None, :]) & 1
                causal = causal & ((rel[None, :] < 0) | (bit != 0))
            qk = tl.where(causal, qk * scale_log2e, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            if TREE:  # a row may see no key of a tile before its first visible one: subtract 0, not -inf
                m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_sub = m_new
            qk = qk - m_sub[:, None]
        else:
            m_new = tl.maximum(m_i, tl.max(qk, axis=1) * scale_log2e)
            m_sub = m_new
            qk = qk * scale_log2e - m_new[:, None]
        p = tl.exp2(qk)
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if USE_TMA:
            v = v_desc.load([row, kv_col])  # [BLOCK_N, BLOCK_D]
            if QUANT != 0:
                v = v.to(q.dtype)
            if MASKED:  # rows past seq_len are stale cache slots (maybe NaN): p = 0 there, v must be finite
                v = tl.where(nmask[:, None], v, 0.0)
        elif MASKED:
            v = tl.load(v_ptrs, mask=nmask[:, None] & dmask[None, :], other=0.0)
        elif BLOCK_D != HEAD_DIM:
            v = tl.load(v_ptrs, mask=dmask[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs)
        if QUANT != 0 and not USE_TMA:
            v = v.to(q.dtype)
        if QUANT == 1:
            p = p * vs[None, :]  # the V scale rides on p; l_i above summed the unscaled p
        # Accumulate in place (the MMA's C operand is acc): no second [BLOCK_M, D] register tile.
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        return acc, l_i, m_new

    @triton.jit
    def _prefill_kernel(
        Q, KC, VC, Out, BlockTables, QueryStartLoc, SeqLens, KDesc, VDesc, KS, VS, TreeMask,
        scale_log2e,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        stride_s_slot,  # int8 scales viewed as [num_slots, H_kv]: H_kv
        stride_bt, stride_tm,
        GROUP: tl.constexpr, PAGE: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
        USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr, QUANT: tl.constexpr, TREE: tl.constexpr,
        TREE_ROWS: tl.constexpr,
    ):
        seq = tl.program_id(1)
        head = tl.program_id(2)
        q_start = tl.load(QueryStartLoc + seq)
        q_len = tl.load(QueryStartLoc + seq + 1) - q_start
        m_block = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest tiles first
        m0 = m_block * BLOCK_M
        if m0 >= q_len:
            return
        seq_len = tl.load(SeqLens + seq)
        ctx = seq_len - q_len  # cached prefix length

        offs_m = m0 + tl.arange(0, BLOCK_M)
        mmask = offs_m < q_len
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < HEAD_DIM
        q_rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=mmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

        kv_head = head // GROUP
        k_base = KC + kv_head * stride_kh
        v_base = VC + kv_head * stride_vh
        kv_col = kv_head * HEAD_DIM  # column of this kv head in the [num_slots, H_kv * D] view (TMA)
        bt_row = BlockTables + seq.to(tl.int64) * stride_bt
        offs_m_pos = ctx + offs_m  # absolute positions of this tile's queries
        ks_base = KS + kv_head  # int8: + slot * stride_s_slot; fp8: the per-head scale itself
        vs_base = VS + kv_head
        if QUANT == 2:  # fp8: the layer's static per-head K scale joins the softmax scale
            scale_log2e = scale_log2e * tl.load(ks_base)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # Keys < ctx + m0 + 1 are visible to every row of the tile: no mask.
        full_end = ((ctx + m0 + 1) // BLOCK_N) * BLOCK_N
        tree_start = seq_len - tl.minimum(q_len, TREE_ROWS)  # first key of the tree region (TREE only)
        tree_bits = tl.full([BLOCK_M], -1, tl.int64)  # rows before the region: every bit (plain causal)
        if TREE:
            rel_m = offs_m_pos - tree_start  # [BLOCK_M] row index inside the tree region
            in_tree = mmask & (rel_m >= 0)
            tree_bits = tl.load(TreeMask + seq.to(tl.int64) * stride_tm + tl.maximum(rel_m, 0), mask=in_tree,
                                other=-1)
            # Tree keys go through the masked loop: the unmasked one stops at the region's first tile.
            full_end = tl.minimum(full_end, (tree_start // BLOCK_N) * BLOCK_N)
        if WARP_SPEC:
            for start_n in tl.range(0, full_end, BLOCK_N, warp_specialize=True):
                acc, l_i, m_i = _attend_tile(
                    acc, l_i, m_i, q, k_base, v_base, KDesc, VDesc, kv_col, bt_row, start_n, offs_m_pos,
                    seq_len, scale_log2e, stride_kb, stride_ks, stride_vb, stride_vs, offs_d, dmask,
                    ks_base, vs_base, stride_s_slot, tree_bits, tree_start,
                    False, PAGE, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, USE_TMA, QUANT, TREE)
        else:
            for start_n in range(0, full_end, BLOCK_N):
                acc, l_i, m_i = _attend_tile(
                    acc, l_i, m_i, q, k_base, v_base, KDesc, VDesc, kv_col, bt_row, start_n, offs_m_pos,
                    seq_len, scale_log2e, stride_kb, stride_ks, stride_vb, stride_vs, offs_d, dmask,
                    ks_base, vs_base, stride_s_slot, tree_bits, tree_start,
                    False, PAGE, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, USE_TMA, QUANT, TREE)
        # Diagonal band: keys up to the tile's last row (or the sequence end), causal mask.
        band_end = tl.minimum(seq_len, ctx + m0 + BLOCK_M)
        for start_n in range(full_end, band_end, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, k_base, v_base, KDesc, VDesc, kv_col, bt_row, start_n, offs_m_pos,
                seq_len, scale_log2e, stride_kb, stride_ks, stride_vb, stride_vs, offs_d, dmask,
                ks_base, vs_base, stride_s_slot, tree_bits, tree_start,
                True, PAGE, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, USE_TMA, QUANT, TREE)

        # Every valid row saw key 0 at least, so l_i > 0 there; padded rows are not stored.
        out = acc / l_i[:, None]
        if QUANT == 2:  # fp8: the per-head V scale, once per output tile
            out = out * tl.load(vs_base)
        tl.store(Out + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def default_prefill_config(head_dim: int, dtype: torch.dtype, on_cuda: bool, block_size: int = 16,
                           max_query_len: int = 8192) -> dict:
    """Tile sizes and launch parameters: small tiles under the interpreter, measured ones on the H200.

    H200, bf16, D 128, 32/8 heads (bench/results/attention-*.json): with block_size 16 (per-key block-table
    gather) BLOCK 128x128 / 8 warps is best from 8k up (350 TFLOP/s at 8k) and 64x64 / 4 warps below 4k;
    with block_size a multiple of 64 the tensor-descriptor (TMA) path at 128x64 / 4 warps / 2 stages reaches
    451/482/507 TFLOP/s at 4k/8k/16k (0.86-0.89x cuDNN SDPA; bench/results/attention-blocksize-20261201.json),
    3 stages 1-3% less, 256-row tiles (8 warps) and 128x32 less still.
    """
    if not on_cuda:
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    if dtype == torch.float32 or head_dim > 128:  # fp32 / wide tiles: keep shared memory under 228 KB
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    if head_dim <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    if block_size % 64 == 0 and head_dim == 128:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2, USE_TMA=True)
    if max_query_len <= 4096:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedBatch,
    scale: float,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention of new tokens over their paged context (prefill, chunked prefill, extend,
    speculative verification of a chain or, with ``tree_mask``, of a token tree).

    Args:
        q: [num_tokens, H, D] fp32/fp16/bf16 (RoPE'd), rows of sequence i at
            query_start_loc[i]:query_start_loc[i+1]. D any size (padded to a power of two inside).
        k_cache, v_cache: [num_blocks, block_size, H_kv, D], already holding this step's k/v: q's dtype, or
            int8 / float8_e4m3fn codes with ``k_scale``/``v_scale`` (float32; int8 [num_blocks, block_size,
            H_kv], fp8 [H_kv]; see ``roofline.kernels.common``).
        meta: uses query_start_loc [num_seqs+1] int32, seq_lens [num_seqs] int32, block_tables
            [num_seqs, max_blocks] int32, max_query_len (host int, sizes the grid).
        scale: softmax scale, usually 1/sqrt(D).
        out: optional [num_tokens, H, D] output in q's dtype.
        config: optional dict(BLOCK_M, BLOCK_N, num_warps, num_stages, USE_TMA, WARP_SPEC) overriding
            :func:`default_prefill_config` (benchmarks sweep it). USE_TMA (CUDA, block_size a multiple of
            BLOCK_N, power-of-2 D) loads K/V tiles with tensor descriptors; otherwise pointer loads.
        tree_mask: optional [num_seqs, W] int64 ancestor bitmasks, W <= ``MAX_TREE_ROWS`` (64), for
            tree verification (module docstring, "Tree mask"). None: plain causal.

    Returns:
        [num_tokens, H, D] in q's dtype; softmax statistics and accumulation in fp32.

    Raises:
        ValueError: H not a multiple of H_kv, shapes disagree, scales that do not fit the cache dtype, or a
            tree_mask of the wrong dtype/shape or wider than ``MAX_TREE_ROWS`` (names the limit).
            RuntimeError: triton missing.
    """
    if triton is None:
        raise RuntimeError("triton is not installed; use ref_prefill_attention on this machine")
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_paged_attention_inputs(q, k_cache, v_cache)
    quant = kv_quant_mode(k_cache, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(q)
    num_seqs = meta.query_start_loc.shape[0] - 1
    tree_rows = check_tree_mask(tree_mask, num_seqs)
    if num_tokens == 0 or num_seqs == 0:
        return out
    cfg = dict(default_prefill_config(head_dim, q.dtype, q.is_cuda, block_size, meta.max_query_len))
    if config:
        cfg.update(config)
    use_tma = bool(cfg.get("USE_TMA", False)) and q.is_cuda and block_size % cfg["BLOCK_N"] == 0 \
        and head_dim == triton.next_power_of_2(head_dim)
    k_desc, v_desc = k_cache, v_cache  # unused placeholders unless use_tma
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        num_slots = k_cache.shape[0] * block_size
        k_desc, v_desc = (TensorDescriptor(c, shape=[num_slots, num_kv_heads * head_dim], strides=[c.stride(1), 1],
                                           block_shape=[cfg["BLOCK_N"], head_dim]) for c in (k_cache, v_cache))
    grid = (triton.cdiv(meta.max_query_len, cfg["BLOCK_M"]), num_seqs, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, meta.block_tables, meta.query_start_loc, meta.seq_lens, k_desc, v_desc,
        k_scale if k_scale is not None else q, v_scale if v_scale is not None else q,  # unused unless quantized
        tree_mask if tree_mask is not None else meta.seq_lens,  # unused without a tree
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads if quant == KV_QUANT_PER_TOKEN else 0,
        meta.block_tables.stride(0), tree_mask.stride(0) if tree_mask is not None else 0,
        GROUP=num_heads // num_kv_heads, PAGE=block_size,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        USE_TMA=use_tma, WARP_SPEC=bool(cfg.get("WARP_SPEC", False)), QUANT=quant,
        TREE=tree_mask is not None, TREE_ROWS=tree_rows,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
