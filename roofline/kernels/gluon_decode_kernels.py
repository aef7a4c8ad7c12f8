"""Stage 1 of split-KV paged decode for an int8 / fp8 (e4m3) KV cache in Gluon (sm_80+ ``mma_v2``; issue 29).

This module imports no torch, so the kernel compiles ahead of time for sm_90 in a Triton-only environment
(``bench/gluon_aot_decode.py``). The launcher and the dispatch are in :mod:`roofline.kernels.gluon_decode`.

One program per (sequence, kv head, split), query_len 1, as the Triton kernels of
``roofline.kernels.decode_attention``; it writes the same fp32 partials (o_s, lse_s base 2) that the same stage-2
kernel reduces. The products are swapped (swap-AB), so the keys, not the 4-8 query heads of the GQA group, fill
the MMA's M dimension of 16:

- ``S^T = K Q^T``: K's codes ``[BLOCK_N, D]`` are the A operand in ``DotOperandLayout(k_width=8)``: one thread's
  8 operand values are 8 contiguous codes along head_dim, one 8-byte load, converted to fp16 in registers
  (int8 and e4m3 codes are exact in fp16) with no shared-memory round trip. Q^T ``[D, 8]`` (the group's heads
  padded to 8 columns, N of m16n8k16) is the B operand, loaded once in fp16. The order of head_dim inside a
  k16 step is permuted identically for both operands by the layout, so the product is unchanged.
- Softmax over the keys (axis 0) in fp32 with exp2; int8's per-key K scale multiplies S^T's rows, its V scale
  multiplies P^T's rows (the row sum l uses P unscaled); fp8's per-head scales fold into the softmax scale and
  the split's output.
- ``O^T = V^T P^T``: V's codes are loaded ``[D, BLOCK_N]`` coalesced along head_dim, converted to fp16 and taken
  to the A operand layout through shared memory (option (a) of the issue); P^T ``[BLOCK_N, 8]`` fp16 to the B
  operand likewise. Accumulation in fp32 ``[D, 8]``.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # pragma: no cover - a Triton without Gluon
    gluon = None

# Query heads per kv head the kernel holds: N of one m16n8k16 MMA.
GLUON_MAX_GROUP = 8
GLUON_HEAD_DIMS = (64, 128)


if gluon is not None:

    @gluon.jit
    def _int8_to_f16x4(codes):
        """int8 codes -> fp16, exact, 4 codes per 32-bit register: byte permutes put each code under the byte
        0x64 (fp16 1024 + its unsigned byte), the xor with 0x80 biases it (1152 + code), one packed fp16
        subtraction of 1152 per two codes (as Marlin's dequantization; no I2F per element)."""
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t, m; xor.b32 t, $2, 0x80808080; mov.b32 m, 0x64806480; "
            "prmt.b32 $0, t, 0x64646464, 0x5140; prmt.b32 $1, t, 0x64646464, 0x7362; "
            "sub.f16x2 $0, $0, m; sub.f16x2 $1, $1, m; }",
            "=r,=r,r", [codes], dtype=gl.float16, is_pure=True, pack=4)

    @gluon.jit
    def _load_tile(n, end, bt_row, k_base, v_base, KS, VS, kv_head, kn, kd, vn, vd, sn, stride_kb, stride_vb,
                   STRIDE_KS: gl.constexpr, STRIDE_VS: gl.constexpr, S_SLOT: gl.constexpr, PAGE: gl.constexpr,
                   QUANT: gl.constexpr):
        """Keys [n, n + BLOCK_N) below ``end``, as exact fp16 values of their codes: K [BLOCK_N, D] in kn/kd's
        layout (the A operand's: converted in registers), V^T [D, BLOCK_N] in vn/vd's, and int8's per-key scales
        [BLOCK_N] in sn's (masked: 0, so stale slots and keys past the split never reach the math; all masked
        when n >= end, the prefetch past the last tile). Converted here so that a prefetched tile is carried
        across the loop in fp16 pairs, not as single bytes (which costs a byte permute per code)."""
        BLOCK_N: gl.constexpr = kn.shape[0]
        if PAGE % BLOCK_N == 0:
            # The tile lies in one cache block: one scalar base per operand, constant per-element offsets.
            page = gl.load(bt_row + n // PAGE, mask=n < end, other=0).to(gl.int64)
            k_ptrs = k_base + page * stride_kb + ((n % PAGE) + kn[:, None]) * STRIDE_KS + kd[None, :]
            v_ptrs = v_base + page * stride_vb + ((n % PAGE) + vn[None, :]) * STRIDE_VS + vd[:, None]
            s_off = (page * PAGE + (n % PAGE) + sn) * S_SLOT + kv_head
        else:
            pk = gl.load(bt_row + (n + kn) // PAGE, mask=n + kn < end, other=0).to(gl.int64)
            pv = gl.load(bt_row + (n + vn) // PAGE, mask=n + vn < end, other=0).to(gl.int64)
            ps = gl.load(bt_row + (n + sn) // PAGE, mask=n + sn < end, other=0).to(gl.int64)
            k_ptrs = k_base + (pk * stride_kb + ((n + kn) % PAGE) * STRIDE_KS)[:, None] + kd[None, :]
            v_ptrs = v_base + (pv * stride_vb + ((n + vn) % PAGE) * STRIDE_VS)[None, :] + vd[:, None]
            s_off = (ps * PAGE + (n + sn) % PAGE) * S_SLOT + kv_head
        k_codes = gl.load(k_ptrs, mask=(n + kn[:, None] < end) & (kd[None, :] >= 0), other=0.0)
        v_codes = gl.load(v_ptrs, mask=(n + vn[None, :] < end) & (vd[:, None] >= 0), other=0.0)
        smask = n + sn < end
        ks = gl.load(KS + s_off, mask=smask, other=0.0)
        vs = gl.load(VS + s_off, mask=smask, other=0.0)
        if QUANT == 1:
            return _int8_to_f16x4(k_codes), _int8_to_f16x4(v_codes), ks, vs
        else:
            return k_codes.to(gl.float16), v_codes.to(gl.float16), ks, vs

    @gluon.jit
    def _gluon_decode_kernel(
        Q, KC, VC, KS, VS, BlockTables, SeqLens, MidO, MidLse,
        scale_log2e,
        stride_qt, stride_qh,
        stride_kb, stride_kh,
        stride_vb, stride_vh,
        stride_bt,
        stride_mt, stride_mh, stride_msp,
        stride_lt, stride_lh,
        STRIDE_KS: gl.constexpr, STRIDE_VS: gl.constexpr,  # slot strides of the caches (H_kv * D when contiguous)
        S_SLOT: gl.constexpr,  # int8 scales viewed as [num_slots, H_kv]: H_kv (0 for fp8)
        GROUP: gl.constexpr, PAGE: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
        SPLIT_ALIGN: gl.constexpr, NUM_SPLITS: gl.constexpr, QUANT: gl.constexpr, NUM_WARPS: gl.constexpr,
        PREFETCH: gl.constexpr,
    ):
        NQ: gl.constexpr = 8  # the group's heads padded to N = 8
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, 8])
        a_k: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
        b_q: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
        a_v: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_p: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        # V^T [HEAD_DIM, BLOCK_N]: a thread holds HEAD_DIM / 8 contiguous codes of one key; 8 threads a key row.
        blk_v: gl.constexpr = gl.BlockedLayout([HEAD_DIM // 8, 1], [8, 4], [1, NUM_WARPS], [0, 1])
        row_l: gl.constexpr = gl.SliceLayout(1, mma)  # [BLOCK_N] keys of S^T, or [HEAD_DIM] of O^T
        col_l: gl.constexpr = gl.SliceLayout(0, mma)  # [NQ] query heads

        seq = gl.program_id(0)
        kv_head = gl.program_id(1)
        split = gl.program_id(2)
        seq_len = gl.load(SeqLens + seq)
        split_len = gl.cdiv(gl.cdiv(seq_len, NUM_SPLITS), SPLIT_ALIGN) * SPLIT_ALIGN
        start = split * split_len
        end = gl.minimum(start + split_len, seq_len)

        # Q^T [HEAD_DIM, NQ] as the B operand, fp16.
        qd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, b_q))
        qh = gl.arange(0, NQ, layout=gl.SliceLayout(0, b_q))
        q_ptrs = Q + seq.to(gl.int64) * stride_qt + (kv_head * GROUP + qh[None, :]) * stride_qh + qd[:, None]
        qt = gl.load(q_ptrs, mask=(qh[None, :] < GROUP) & (qd[:, None] < HEAD_DIM), other=0.0).to(gl.float16)

        kd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, a_k))
        kn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_k))
        vd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, blk_v))
        vn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, blk_v))
        sn = gl.arange(0, BLOCK_N, layout=row_l)

        m_i = gl.full([NQ], float("-inf"), gl.float32, col_l)
        l_i = gl.zeros([NQ], gl.float32, col_l)
        acc = gl.zeros([HEAD_DIM, NQ], gl.float32, mma)
        bt_row = BlockTables + seq.to(gl.int64) * stride_bt
        k_base = KC + kv_head * stride_kh
        v_base = VC + kv_head * stride_vh
        if QUANT == 2:  # fp8: the layer's static per-head K scale joins the softmax scale
            scale_log2e = scale_log2e * gl.load(KS + kv_head)
        # Register double buffering: the next tile's codes and scales are loaded before this tile's math, so a
        # warp keeps a tile of loads in flight while it computes (Gluon does not pipeline loops by itself).
        # PREFETCH (num_stages >= 2): the first tile before the loop, each next one at the top of the loop.
        k16, v16b, ks, vs = _load_tile(start, end, bt_row, k_base, v_base, KS, VS, kv_head, kn, kd, vn, vd, sn,
                                       stride_kb, stride_vb, STRIDE_KS, STRIDE_VS, S_SLOT, PAGE, QUANT)
        for n in range(start, end, BLOCK_N):
            if PREFETCH:
                k_next, v_next, ks_next, vs_next = _load_tile(
                    n + BLOCK_N, end, bt_row, k_base, v_base, KS, VS, kv_head, kn, kd, vn, vd, sn, stride_kb,
                    stride_vb, STRIDE_KS, STRIDE_VS, S_SLOT, PAGE, QUANT)
            else:
                k16, v16b, ks, vs = _load_tile(n, end, bt_row, k_base, v_base, KS, VS, kv_head, kn, kd, vn, vd, sn,
                                               stride_kb, stride_vb, STRIDE_KS, STRIDE_VS, S_SLOT, PAGE, QUANT)
            smask = n + sn < end
            # K reaches the A operand without shared memory: loaded in its layout, converted in registers.
            k16 = gl.convert_layout(k16, a_k, assert_trivial=True)
            s = mma_v2(k16, qt, gl.zeros([BLOCK_N, NQ], gl.float32, mma))  # S^T [BLOCK_N, NQ] fp32
            if QUANT == 1:
                s = s * ks[:, None]  # per-key K scales (0 on masked keys, whose s -> -inf below)
            s = gl.where(smask[:, None], s * scale_log2e, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=0))  # finite: every tile holds a key of this split
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + gl.sum(p, axis=0)
            if QUANT == 1:
                p = p * vs[:, None]  # the V scale rides on p; l_i above sums the unscaled p
            m_i = m_new
            p16 = gl.convert_layout(p.to(gl.float16), b_p)
            v16 = gl.convert_layout(v16b, a_v)  # through shared memory (option (a) of issue 29)
            acc = mma_v2(v16, p16, acc * alpha[None, :])  # O^T [HEAD_DIM, NQ]
            if PREFETCH:
                k16, v16b, ks, vs = k_next, v_next, ks_next, vs_next

        # Empty split (start >= end): l_i = 0, m_i = -inf -> lse = -inf, o = 0; the reduction gives it weight 0.
        safe_l = gl.where(l_i > 0, l_i, 1.0)
        o = acc / safe_l[None, :]
        if QUANT == 2:  # fp8: the per-head V scale, once per split
            o = o * gl.load(VS + kv_head)
        lse = gl.where(l_i > 0, m_i + gl.log2(safe_l), float("-inf"))
        od = gl.arange(0, HEAD_DIM, layout=row_l)
        oh = gl.arange(0, NQ, layout=col_l)
        heads = kv_head * GROUP + oh
        row = seq.to(gl.int64)
        mid = MidO + row * stride_mt + heads[None, :] * stride_mh + split * stride_msp + od[:, None]
        gl.store(mid, o, mask=(oh[None, :] < GROUP) & (od[:, None] < HEAD_DIM))
        gl.store(MidLse + row * stride_lt + heads * stride_lh + split, lse, mask=oh < GROUP)
