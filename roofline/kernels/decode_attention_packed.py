"""Stage 1 of split-KV decode with the query rows packed into one tile: ``variant="mma"`` and ``"fma"``
of :func:`roofline.kernels.decode_attention.paged_decode_attention` (issue 29).

One program per (sequence, kv head, split), as in the original kernel (``variant="old"``), but its tile
rows are every query the kv head serves: the GQA group's ``GROUP`` heads times the request's
``QLEN`` query positions (one for plain decode, 1 + k for a speculative verify step), row
``r = t * GROUP + g`` for position t and head g. So each K/V byte is read once per step however many
queries share it, and at ``QLEN * GROUP >= 16`` the MMA's M dimension has no padding.

Two ways to compute the tile (both stream the same bytes; which is faster is measured, see
``roofline bench attention --decode-only --variants``):

- ``mma`` (``USE_DOT``): ``tl.dot`` with M = the packed rows padded to 16. K is loaded as a
  [D, BLOCK_N] tile (the dot's B operand without a transpose). The tile of codes is converted once to
  the dot dtype; int8 codes through the fp16/fp32 "magic number" (``code + 0x6480`` reinterpreted as
  fp16 is ``1152 + code``, one integer add and one subtraction instead of a conversion per element,
  as Marlin's ``lop3`` dequantization does) and e4m3 codes with the native conversion.
- ``fma`` (not ``USE_DOT``): CUDA cores only, ``tl.sum`` over a [M, N, D] broadcast, M = the packed
  rows padded to a power of two (4 for a group of 4): no padding to 16, no shared-memory round trip to
  reach an MMA operand layout.

Scales are never applied per element: int8's per-key scales multiply the fp32 scores' columns after
the QK product and p's columns before the PV product (the row sum l uses p unscaled); fp8's per-head
scales fold into the softmax scale (K) and the split's output (V). Output: the same fp32 partials
(o_s, lse_s base 2) as the original kernel, reduced by the same stage-2 kernel.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# The largest packed tile (query positions x GROUP) one program holds: [M, D] fp32 accumulators.
MAX_PACKED_ROWS = 128
VARIANTS = ("old", "mma", "fma")


def packed_rows(group: int, query_len: int, use_dot: bool) -> int:
    """Rows of the packed tile: ``group * query_len`` rounded up to a power of two (and to 16 for tl.dot).

    Raises:
        ValueError: ``group * query_len`` above :data:`MAX_PACKED_ROWS` (names both and the limit).
    """
    rows = group * query_len
    if rows > MAX_PACKED_ROWS:
        raise ValueError(f"group {group} x query_len {query_len} = {rows} query rows per kv head; the packed "
                         f"decode kernel holds at most {MAX_PACKED_ROWS}")
    block_m = 1 << max(0, (rows - 1).bit_length())
    return max(16, block_m) if use_dot else max(2, block_m)


if triton is not None:

    @triton.jit
    def _int8_codes_to(codes, F16: tl.constexpr, MAGIC: tl.constexpr):
        """int8 codes -> fp16 (F16) or fp32, exact. MAGIC: one integer add into a float's mantissa and one
        float subtraction (fp16: 0x6400 is 1024, +128 biases the code positive; fp32: 0x4B400000 is 1.5 * 2^23,
        whose unit in the last place is 1, so a signed code added to its bits is added to its value)."""
        if MAGIC:
            if F16:
                return (codes.to(tl.int16) + 0x6480).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
            else:
                return (codes.to(tl.int32) + 0x4B400000).to(tl.int32).to(tl.float32, bitcast=True) - 12582912.0
        else:
            if F16:
                return codes.to(tl.float16)
            else:
                return codes.to(tl.float32)

    @triton.jit
    def _decode_packed_kernel(
        Q, KC, VC, KS, VS, BlockTables, SeqLens, MidO, MidLse,
        scale_log2e,
        stride_qt, stride_qh,
        stride_kb, stride_kh,
        stride_vb, stride_vh,
        stride_bt,
        stride_mt, stride_mh, stride_msp,  # MidO [num_seqs * QLEN, H, num_splits, D] (MidLse has no D dim)
        stride_lt, stride_lh,
        STRIDE_KS: tl.constexpr, STRIDE_VS: tl.constexpr,  # slot strides of the caches (H_kv * D when contiguous)
        S_SLOT: tl.constexpr,  # int8 scales viewed as [num_slots, H_kv]: H_kv (0 otherwise)
        GROUP: tl.constexpr, QLEN: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_ALIGN: tl.constexpr,
        NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr, DOT_F16: tl.constexpr,
        USE_DOT: tl.constexpr, INT8_MAGIC: tl.constexpr, RESCALE_LOG2: tl.constexpr,
        CODES_F16: tl.constexpr,  # the dots' operand dtype is fp16 (else q's: fp32)
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(SeqLens + seq)
        # Split length rounded to SPLIT_ALIGN keys (whole tiles, or whole pages when pages are larger).
        split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), SPLIT_ALIGN) * SPLIT_ALIGN
        start = split * split_len
        end = tl.minimum(start + split_len, seq_len)

        offs_m = tl.arange(0, BLOCK_M)  # packed rows: r = t * GROUP + g
        mmask = offs_m < GROUP * QLEN
        t = offs_m // GROUP
        heads = kv_head * GROUP + offs_m % GROUP
        q_rows = (seq * QLEN + t).to(tl.int64)
        q_pos = seq_len - QLEN + t  # absolute position of each row's query: it sees keys 0..q_pos
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < HEAD_DIM
        q = tl.load(Q + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        if USE_DOT:
            if DOT_F16:  # bf16 q with a quantized cache: both dots in fp16 (codes exact, 3 more mantissa bits)
                q = q.to(tl.float16)
        else:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        bt_row = BlockTables + seq.to(tl.int64) * stride_bt
        k_base = KC + kv_head * stride_kh
        v_base = VC + kv_head * stride_vh
        if QUANT == 2:  # fp8: the layer's static per-head K scale joins the softmax scale
            scale_log2e = scale_log2e * tl.load(KS + kv_head)
        for n in range(start, end, BLOCK_N):
            offs_n = n + tl.arange(0, BLOCK_N)
            nmask = offs_n < end
            if PAGE % BLOCK_N == 0:
                # The tile lies in one cache block: one scalar base pointer per operand, and per-element offsets
                # that are compile-time constants (slot strides are constexpr), so no per-element 64-bit
                # address arithmetic: the loads take [base + immediate] addresses.
                page = tl.load(bt_row + n // PAGE).to(tl.int64)
                slot0 = page * PAGE + n % PAGE  # scalar: the tile's first slot
                k_tile = k_base + page * stride_kb + (n % PAGE) * STRIDE_KS
                v_tile = v_base + page * stride_vb + (n % PAGE) * STRIDE_VS
                local = tl.arange(0, BLOCK_N)
                v_ptrs = v_tile + local[:, None] * STRIDE_VS + offs_d[None, :]
                kt_ptrs = k_tile + local[None, :] * STRIDE_KS + offs_d[:, None]
                k_ptrs = k_tile + local[:, None] * STRIDE_KS + offs_d[None, :]
                s_off = slot0 * S_SLOT + kv_head + local * S_SLOT
            else:
                page = tl.load(bt_row + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)  # [BLOCK_N]
                k_row = page * stride_kb + (offs_n % PAGE) * STRIDE_KS
                v_row = page * stride_vb + (offs_n % PAGE) * STRIDE_VS
                v_ptrs = v_base + v_row[:, None] + offs_d[None, :]
                kt_ptrs = k_base + k_row[None, :] + offs_d[:, None]
                k_ptrs = k_base + k_row[:, None] + offs_d[None, :]
                s_off = (page * PAGE + offs_n % PAGE) * S_SLOT + kv_head
            v = tl.load(v_ptrs, mask=nmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            if USE_DOT:
                # [BLOCK_D, BLOCK_N]: the B operand as stored, no transpose
                kt = tl.load(kt_ptrs, mask=nmask[None, :] & dmask[:, None], other=0.0)
                if QUANT == 1:
                    kt = _int8_codes_to(kt, CODES_F16, INT8_MAGIC)
                    v = _int8_codes_to(v, CODES_F16, INT8_MAGIC)
                elif QUANT == 2:
                    kt = kt.to(q.dtype)
                    v = v.to(q.dtype)
                qk = tl.dot(q, kt, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
            else:
                k = tl.load(k_ptrs, mask=nmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
                if QUANT == 1:
                    k = _int8_codes_to(k, False, INT8_MAGIC)
                    v = _int8_codes_to(v, False, INT8_MAGIC)
                else:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                qk = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_M, BLOCK_N] on CUDA cores
            if QUANT == 1:
                # Per-key scales, masked loads (a stale slot's scale may be NaN): 0 there, and qk -> -inf below.
                ks = tl.load(KS + s_off, mask=nmask, other=0.0)
                vs = tl.load(VS + s_off, mask=nmask, other=0.0)
                qk = qk * ks[None, :]
            if QLEN > 1:  # causal among the step's own positions: row t sees keys <= its position
                visible = nmask[None, :] & (offs_n[None, :] <= q_pos[:, None])
            else:
                visible = nmask[None, :]
            qk = tl.where(visible, qk * scale_log2e, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            if RESCALE_LOG2 > 0:
                # Lazy rescaling (as in FlashAttention-4): keep the stale max until some row's max grows by more
                # than 2^RESCALE_LOG2, so most tiles skip the [M, D] accumulator rescale; p <= 2^RESCALE_LOG2
                # meanwhile, far inside fp32, and p * v_scale inside fp16 (<= 65504) unless an int8 V scale
                # exceeds 65504 / 2^RESCALE_LOG2 = 256 (|v| > 32512 at 8; rescale_log2=0 removes the bound).
                grow = m_new - tl.maximum(m_i, -1e30)  # -inf while a row has seen no key, huge at its first
                if tl.max(grow, axis=0) > RESCALE_LOG2:
                    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = tl.exp2(m_i - m_sub)
                    acc = acc * alpha[:, None]
                    l_i = l_i * alpha
                    m_i = m_new
                # A row may have seen no key yet (QLEN > 1): its max is -inf; subtract 0 so p = 0, not NaN.
                m_sub = tl.where(m_i == float("-inf"), 0.0, m_i)
                p = tl.exp2(qk - m_sub[:, None])
                l_i = l_i + tl.sum(p, axis=1)
                if QUANT == 1:
                    p = p * vs[None, :]  # the V scale rides on p; l_i above sums the unscaled p
                if USE_DOT:
                    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
                else:
                    acc = acc + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            else:
                # A row may see no key of this tile (QLEN > 1): keep its max -inf but subtract 0: p = 0, not NaN.
                m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_sub)
                p = tl.exp2(qk - m_sub[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if QUANT == 1:
                    p = p * vs[None, :]  # the V scale rides on p; l_i above sums the unscaled p
                if USE_DOT:
                    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
                else:
                    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
                m_i = m_new

        # A row with no key in this split (empty split, or QLEN > 1 rows before it): lse = -inf, o = 0.
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o = acc / safe_l[:, None]
        if QUANT == 2:  # fp8: the per-head V scale, once per split
            o = o * tl.load(VS + kv_head)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        mid = MidO + q_rows[:, None] * stride_mt + heads[:, None] * stride_mh + split * stride_msp + offs_d[None, :]
        tl.store(mid, o, mask=mmask[:, None] & dmask[None, :])
        tl.store(MidLse + q_rows * stride_lt + heads * stride_lh + split, lse, mask=mmask)


def launch_packed_split(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, mid_o, mid_lse,
                        scale_log2e: float, quant: int, per_token_stride: int, query_len: int, num_splits: int,
                        block_n: int, split_align: int, use_dot: bool, int8_magic: bool, rescale_log2: float,
                        num_warps: int, num_stages: int) -> None:
    """Stage 1 of the packed variants: fills mid_o [T, H, S, D] / mid_lse [T, H, S] (T = num_seqs * query_len).

    Called by ``paged_decode_attention`` after it has checked the inputs; the arguments are its own.
    """
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    _decode_packed_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache,
        k_scale if k_scale is not None else q, v_scale if v_scale is not None else q,  # unused unless quantized
        block_tables, seq_lens, mid_o, mid_lse,
        scale_log2e,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(2),
        block_tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        STRIDE_KS=k_cache.stride(1), STRIDE_VS=v_cache.stride(1), S_SLOT=per_token_stride,
        GROUP=group, QLEN=query_len, BLOCK_M=packed_rows(group, query_len, use_dot), PAGE=block_size,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=block_n, SPLIT_ALIGN=split_align,
        NUM_SPLITS=num_splits, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", QUANT=quant,
        DOT_F16=bool(quant) and q.dtype == torch.bfloat16, USE_DOT=use_dot, INT8_MAGIC=int8_magic,
        RESCALE_LOG2=rescale_log2, CODES_F16=q.dtype in (torch.float16, torch.bfloat16),
        num_warps=num_warps, num_stages=num_stages,
    )
