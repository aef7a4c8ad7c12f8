"""INT4 (W4A16) GEMM for small M on sm_80+ in Gluon: weights dequantized in registers straight into the tensor
core's B-operand fragments (``mma.sync m16n8k16``), no shared memory, after a one-time repack at load.

Why: at M = 1-64 the Triton INT4 kernels are instruction-bound. The plain GEMV spends ~6 SASS instructions
per weight (one LOP3, FADD, FFMA per weight plus x broadcast and addressing: 393 per 64-weight tile on sm_90);
the 16-row ``tl.dot`` kernel stages every dequantized tile through shared memory because Hopper's ``wgmma``
takes B from shared memory. Here each thread's 32-bit word holds exactly the eight 4-bit codes of its B
fragments (the *mma layout*, written by ``quant_layouts.repack_int4_mma``): per word three shifts, four LOP3
(two codes each into a bf16 pair with the exponent magic ``0x4300`` = 128.0), four ``fma.rn.bf16x2`` (minus
``128 + z``: exact) and one HMMA per 4 words: ~3 SASS instructions per weight (``bench/gluon_aot_w4a16.py``
prints the inner loop's mix). The group scale multiplies the fp32 accumulator once per group, so the products
``x * (q - z)`` are exact in the tensor core, as in the FP32 GEMV.

The operands use ``k_width = 8``: within each k32 block, lane column t (0..3) of a warp holds input channels
``8 t .. 8 t + 7`` of both A (x) and B (the weights); the k order inside an ``mma`` differs from the natural
one identically for A and B, which leaves the dot product unchanged. So a thread loads x with 16-byte loads
and needs one word per (k32 block, column).

The mma layout: int32 ``[K / 128, N * 16]``; the word at ``[kt, 16 n + 4 t + rb]`` holds the codes of input
channels ``128 kt + 32 rb + 8 t + j`` (j = 0..7) at bit ``16 (j % 2) + 4 (j // 2)`` (pairs (j, j + 1) share one
LOP3). One 16-byte load per (t, n) brings a thread a k-tile's 4 words; a warp's loads are 512 contiguous bytes.

This module imports no torch (so it compiles ahead of time for sm_90 in a Triton-only environment);
``roofline.kernels.quant_gemm.w4a16_mma_gemm`` launches it.

References: Frantar et al. 2024, "MARLIN: Mixed-Precision Auto-Regressive Parallel Inference on Large Language
Models" (fragment-layout repack, LOP3 exponent-magic dequantization); NVIDIA PTX ISA 8.x,
``mma.sync.aligned.m16n8k16`` fragment layouts, ``lop3.b32``, ``fma.rn.bf16x2``.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
except ImportError:  # pragma: no cover - Triton without Gluon
    gluon = None

MMA_K_TILE = 128  # input channels per word tile of the mma layout (4 words per (t, n))

if gluon is not None:

    @gluon.jit
    def _gdc_wait():
        # griddepcontrol.wait (PTX ISA 7.8, sm_90): as triton.language.extra.cuda.gdc_wait, which Gluon cannot call.
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)

    @gluon.jit
    def _gdc_launch_dependents():
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _pdl_sync(PDL: gl.constexpr):
        # Programmatic dependent launch (roofline.kernels.pdl), once the first weight tile is in flight: wait for
        # the previous kernel (mode > 0), and with mode 1 release the next kernel at once.
        if PDL:
            _gdc_wait()
            if PDL == 1:
                _gdc_launch_dependents()

    @gluon.jit
    def _load_x_tile4(xk, bmask):
        # x^T's k-tile from xk (pointers [32, BLOCK_M] at its first channel) as the four k32 B operands
        return (gl.load(xk, mask=bmask, other=0.0), gl.load(xk + 32, mask=bmask, other=0.0),
                gl.load(xk + 64, mask=bmask, other=0.0), gl.load(xk + 96, mask=bmask, other=0.0))

    @gluon.jit
    def _dequant8(w, zz):
        # w int32: the codes of 8 input channels j = 0..7, nibble j at bit 16 (j % 2) + 4 (j // 2); zz int32:
        # the bf16 pair (128 + z, 128 + z). Returns q_j - z as 8 bf16 values, exact.
        return gl.inline_asm_elementwise(
            """
            {
            .reg .b32 q, p0, p1, p2, p3;
            .reg .b32 one;
            mov.b32 one, 0x3F803F80;
            lop3.b32 p0, $8, 0x000F000F, 0x43004300, 0xEA;
            shr.u32 q, $8, 4;
            lop3.b32 p1, q, 0x000F000F, 0x43004300, 0xEA;
            shr.u32 q, $8, 8;
            lop3.b32 p2, q, 0x000F000F, 0x43004300, 0xEA;
            shr.u32 q, $8, 12;
            lop3.b32 p3, q, 0x000F000F, 0x43004300, 0xEA;
            xor.b32 q, $9, 0x80008000;
            fma.rn.bf16x2 p0, p0, one, q;
            fma.rn.bf16x2 p1, p1, one, q;
            fma.rn.bf16x2 p2, p2, one, q;
            fma.rn.bf16x2 p3, p3, one, q;
            mov.b32 {$0, $1}, p0;
            mov.b32 {$2, $3}, p1;
            mov.b32 {$4, $5}, p2;
            mov.b32 {$6, $7}, p3;
            }
            """,
            "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
            [w, zz],
            dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16,
                   gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
            is_pure=True,
            pack=1,
        )

    @gluon.jit
    def _a_fragment(w, zz, BN: gl.constexpr, A_LAYOUT: gl.constexpr):
        # w int32 [BN / 16, 2, 8, 4] (c, h, g, t): one k32 block's words of rows n = 16 c + 8 h + g; zz the
        # matching (128 + z) pairs -> bf16 [BN, 32] (q - z), k = 8 t + j, in A_LAYOUT (no data movement).
        v0, v1, v2, v3, v4, v5, v6, v7 = _dequant8(w, zz)
        # The first join is the innermost register pair: (j, j + 1) share a 32-bit register, as in the MMA.
        a = gl.join(gl.join(gl.join(v0, v1), gl.join(v2, v3)), gl.join(gl.join(v4, v5), gl.join(v6, v7)))
        a = gl.permute(a, (0, 1, 2, 3, 6, 5, 4))  # [c, h, g, t, j0, j1, j2] -> [c, h, g, t, j2, j1, j0]
        a = gl.reshape(a, [BN, 32])
        return gl.convert_layout(a, A_LAYOUT, assert_trivial=True)

    @gluon.jit
    def _split_tile(words, z_next):
        # a k-tile's words [C, 2, 8, 4, 4] (c, h, g, t, rb) -> the four k32 blocks' words [C, 2, 8, 4] (rb 0..3),
        # and the zero points [C, 2, 8, 1] as bf16x2 pairs (128 + z, 128 + z) for _dequant8
        z = z_next.to(gl.float32)
        zb = (z + 128.0).to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        zz = zb | (zb << 16)
        C: gl.constexpr = words.shape[0]
        w01, w23 = gl.split(gl.reshape(words, [C, 2, 8, 4, 2, 2]))  # rb = 2 a + b: (rb 0, 2) | (rb 1, 3)
        w0, w2 = gl.split(w01)
        w1, w3 = gl.split(w23)
        return w0, w1, w2, w3, zz

    @gluon.jit
    def _tile_offsets(row0, BN: gl.constexpr, w_layout: gl.constexpr, q_layout: gl.constexpr):
        # For the column tile of BN rows from row0: the words' offsets [C, 2, 8, 4, 4] in a k-tile of the mma
        # layout in w_layout, and the zero points' column offsets [C, 2, 8, 1] in q_layout (row0 is added before
        # the broadcasts: adding it to the 5-D offsets afterwards cost 5-100 registers in ptxas); the layouts are the kernels' (words: rows n = 16 c + 8 h + g, rb and h in
        # registers, one 16-byte load per (n, t), lanes t fastest then g, warps along c, cyclically).
        C: gl.constexpr = BN // 16
        l4: gl.constexpr = gl.SliceLayout(4, w_layout)
        offs_c = gl.arange(0, C, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, l4))))
        offs_h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, l4))))
        offs_g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, l4))))
        offs_t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, l4))))
        offs_rb = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(
            3, w_layout)))))
        n4 = row0 + offs_c[:, None, None, None] * 16 + offs_h[None, :, None, None] * 8 + offs_g[None, None, :, None]
        w_off = ((n4 * 16 + offs_t[None, None, None, :] * 4)[:, :, :, :, None] + offs_rb[None, None, None, None, :])
        qc = gl.arange(0, C, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, q_layout))))
        qh = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, q_layout))))
        qg = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, q_layout))))
        offs_zn = row0 + qc[:, None, None, None] * 16 + qh[None, :, None, None] * 8 + qg[None, None, :, None]
        return w_off, offs_zn

    @gluon.jit
    def _mma_tile(acc, words, z_next, s_next, x0, x1, x2, x3, C: gl.constexpr, BN: gl.constexpr,
                  BLOCK_M: gl.constexpr, MMA: gl.constexpr, A_LAYOUT: gl.constexpr, Q_LAYOUT: gl.constexpr):
        # One k-tile (128 input channels): acc [BN, BLOCK_M] fp32 += s * (W[rows, tile] - z) @ x^T[tile, :], the
        # words [C, 2, 8, 4, 4] (c, h, g, t, rb) of the tile's rows, z / s their group's zero points and scales.
        w0, w1, w2, w3, zz = _split_tile(words, z_next)
        s = s_next.to(gl.float32)
        accg = gl.zeros([BN, BLOCK_M], gl.float32, MMA)
        accg = mma_v2(_a_fragment(gl.convert_layout(w0, Q_LAYOUT, assert_trivial=True), zz, BN, A_LAYOUT), x0, accg)
        accg = mma_v2(_a_fragment(gl.convert_layout(w1, Q_LAYOUT, assert_trivial=True), zz, BN, A_LAYOUT), x1, accg)
        accg = mma_v2(_a_fragment(gl.convert_layout(w2, Q_LAYOUT, assert_trivial=True), zz, BN, A_LAYOUT), x2, accg)
        accg = mma_v2(_a_fragment(gl.convert_layout(w3, Q_LAYOUT, assert_trivial=True), zz, BN, A_LAYOUT), x3, accg)
        return acc + accg * s[:, None]

    @gluon.jit
    def _store_tile(acc, Out, Partials, Counters, pid_n, split, M, N, stride_om, SPLIT_K, BN: gl.constexpr,
                    BLOCK_M: gl.constexpr, MMA: gl.constexpr):
        # out[:, pid_n's BN columns] = acc^T in bf16; with split-K the last program of the column tile to arrive
        # sums the partials in split order (deterministic) and re-arms the counter, as
        # roofline.kernels.splitk._splitk_epilogue.
        offs_on = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
        offs_om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
        omask = (offs_on < N)[:, None] & (offs_om < M)[None, :]
        out_ptrs = Out + offs_om[None, :].to(gl.int64) * stride_om + offs_on[:, None]
        if SPLIT_K == 1:
            gl.store(out_ptrs, acc.to(gl.bfloat16), mask=omask)
        else:
            mn = offs_om[None, :].to(gl.int64) * N + offs_on[:, None]
            gl.store(Partials + split.to(gl.int64) * M * N + mn, acc, mask=omask)
            gl.thread_barrier()
            arrived = gl.atomic_add(Counters + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = gl.zeros([BN, BLOCK_M], gl.float32, MMA)
                for sp in range(SPLIT_K):
                    total += gl.load(Partials + sp * M * N + mn, mask=omask, other=0.0, cache_modifier=".cg")
                gl.store(out_ptrs, total.to(gl.bfloat16), mask=omask)
                gl.atomic_xchg(Counters + pid_n, 0)

    @gluon.jit
    def _w4a16_mma_kernel(
        X, W, S, Z, Out, Partials, Counters,
        M, N, K, k_tiles_per_split, SPLIT_K,
        stride_xm, stride_sg, stride_om,
        BLOCK_M: gl.constexpr, BN: gl.constexpr, NUM_WARPS: gl.constexpr, STAGES: gl.constexpr = 1,
        XPRE: gl.constexpr = 1, PDL: gl.constexpr = 0, PERSIST: gl.constexpr = 0,
    ):
        # STAGES: k-tiles of weights in flight per thread: 1 or 2 in registers, >= 3 through a cp.async ring in
        # shared memory (STAGES - 1 ahead); XPRE: x (the B operand) loaded
        # one tile ahead too (its registers spill at BLOCK_M > 16). PDL (roofline.kernels.pdl): 0 off; 1 wait for the previous kernel once the first weight tile is in
        # flight (the weights never depend on it; x does), then release the next kernel; 2 release after the loop.
        # PERSIST: 0, grid (N / BN, SPLIT_K), one work item (column tile, K split) per program; 1, a persistent
        # 1-D grid of P programs, program p taking items p, p + P, ... as one stream of k-tiles whose next tile
        # (the next item's first, at an item's end) is always in flight (STAGES 1 and XPRE only; SPLIT_K must
        # divide K / 128; item i = (column tile i % (N / BN), split i // (N / BN))).
        # out^T [N, M] = W [N, K] @ x^T [K, M] ("swap AB": the weights are the MMA's A operand, 16 output
        # channels per m16n8k16 row block; the activations are B, 8 rows per n8 block, so M = 1-8 wastes
        # only B's few registers). X bf16 [M, K] (M <= BLOCK_M, a multiple of 8); W int32 [K / 128, N * 16]
        # (mma layout); S, Z bf16 [K / 128, N] (group 128); Out bf16 [M, N]; Partials fp32 [SPLIT_K, M, N]
        # and Counters int32 [N / BN] for split-K. BN a multiple of 16 * NUM_WARPS.
        C: gl.constexpr = BN // 16
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, 8])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
        b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
        # words [C, 2 (h), 8 (g), 4 (t), 4 (rb)] for rows n = 16 c + 8 h + g (_tile_offsets)
        w_layout: gl.constexpr = gl.BlockedLayout([1, 2, 1, 1, 4], [1, 1, 8, 4, 1], [NUM_WARPS, 1, 1, 1, 1],
                                                  [4, 1, 3, 2, 0])
        q_layout: gl.constexpr = gl.BlockedLayout([1, 2, 1, 1], [1, 1, 8, 4], [NUM_WARPS, 1, 1, 1], [1, 3, 2, 0])
        tile_words = 16 * N  # one k-tile (128 input channels) of the mma layout
        offs_sn = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        offs_bk = gl.arange(0, 32, layout=gl.SliceLayout(1, b_layout))
        offs_bm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, b_layout))
        bmask = (offs_bm < M)[None, :]
        x_cols = X + offs_bm[None, :].to(gl.int64) * stride_xm + offs_bk[:, None]  # x^T [32, BLOCK_M]
        k_tiles = K // 128

        if PERSIST:
            # One stream of steps (item, k-tile) per program; everything step s + 1 needs is loaded in step s.
            # Offsets within a column tile (the item's pid_n * BN * 16 words are added to the base pointers).
            w_off, offs_zn = _tile_offsets(0, BN, w_layout, q_layout)
            nprog = gl.num_programs(0)
            tiles = N // BN
            items = tiles * SPLIT_K
            T = k_tiles_per_split
            steps = ((items - gl.program_id(0) + nprog - 1) // nprog) * T
            item = gl.program_id(0)
            kl = 0
            pid_n = item % tiles
            split = item // tiles
            w_base = W + (split * T).to(gl.int64) * tile_words + pid_n * BN * 16  # the item's first k-tile
            z_base = Z + split * T * stride_sg + pid_n * BN
            s_base = S + split * T * stride_sg + pid_n * BN
            x_base = x_cols + split * T * 128
            w_next = gl.load(w_base + w_off)
            z_next = gl.load(z_base + offs_zn)
            s_next = gl.load(s_base + offs_sn)
            _pdl_sync(PDL)
            x0n, x1n, x2n, x3n = _load_x_tile4(x_base, bmask)
            acc = gl.zeros([BN, BLOCK_M], gl.float32, mma)
            for _ in range(steps):
                words = w_next
                z_cur = z_next
                s_cur = s_next
                x0, x1, x2, x3 = x0n, x1n, x2n, x3n
                # the next step: the item's next k-tile, or the next item's first (the last item's again at the
                # end: an L2 hit); the item's coordinates change only there
                kl_n = kl + 1
                pid_n_n = pid_n
                split_n = split
                item_n = item
                wb_n = w_base
                zb_n = z_base
                sb_n = s_base
                xb_n = x_base
                if kl_n == T:
                    kl_n = 0
                    item_n = gl.minimum(item + nprog, items - 1)
                    pid_n_n = item_n % tiles
                    split_n = item_n // tiles
                    wb_n = W + (split_n * T).to(gl.int64) * tile_words + pid_n_n * BN * 16
                    zb_n = Z + split_n * T * stride_sg + pid_n_n * BN
                    sb_n = S + split_n * T * stride_sg + pid_n_n * BN
                    xb_n = x_cols + split_n * T * 128
                w_next = gl.load(wb_n + kl_n.to(gl.int64) * tile_words + w_off)
                z_next = gl.load(zb_n + kl_n * stride_sg + offs_zn)
                s_next = gl.load(sb_n + kl_n * stride_sg + offs_sn)
                xk = xb_n + kl_n * 128
                x0n, x1n, x2n, x3n = _load_x_tile4(xk, bmask)
                acc = _mma_tile(acc, words, z_cur, s_cur, x0, x1, x2, x3, C, BN, BLOCK_M, mma, a_layout, q_layout)
                if kl == T - 1:
                    _store_tile(acc, Out, Partials, Counters, pid_n, split, M, N, stride_om, SPLIT_K, BN, BLOCK_M,
                                mma)
                    acc = gl.zeros([BN, BLOCK_M], gl.float32, mma)
                kl = kl_n
                item = item_n
                pid_n = pid_n_n
                split = split_n
                w_base = wb_n
                z_base = zb_n
                s_base = sb_n
                x_base = xb_n
            if PDL == 2:
                _gdc_launch_dependents()
        else:
            pid_n = gl.program_id(0)
            split = gl.program_id(1)
            w_off, offs_zn = _tile_offsets(pid_n * BN, BN, w_layout, q_layout)
            offs_sn = offs_sn + pid_n * BN
            kt_start = split * k_tiles_per_split
            kt_end = gl.minimum(kt_start + k_tiles_per_split, k_tiles)
            acc = gl.zeros([BN, BLOCK_M], gl.float32, mma)
            # Everything tile kt needs is loaded one iteration ahead (the words STAGES ahead), so no load in the
            # loop is waited on in the iteration that issues it. Weights, scales and zeros never depend on the
            # previous kernel: they are issued before the PDL wait; x after it.
            if STAGES >= 3:
                # A ring of STAGES k-tiles of words in shared memory, filled by cp.async (LDGSTS) STAGES - 1 tiles
                # ahead. Each thread reads back exactly the 16-byte chunks it copied (same layout both ways), so
                # its own cp.async.wait_group is the only synchronization a slot needs.
                ring_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [4, 3, 2, 1, 0])
                ring = gl.allocate_shared_memory(gl.int32, [STAGES, C, 2, 8, 4, 4], ring_layout)
                for i in gl.static_range(STAGES - 1):
                    kt_i = gl.minimum(kt_start + i, kt_end - 1)
                    async_copy.async_copy_global_to_shared(ring.index(i),
                                                           W + kt_i.to(gl.int64) * tile_words + w_off)
                    async_copy.commit_group()
                w_next = gl.zeros([C, 2, 8, 4, 4], gl.int32, w_layout)  # unused on this path
            else:
                w_next = gl.load(W + kt_start.to(gl.int64) * tile_words + w_off)
            w_next2 = w_next
            if STAGES == 2:
                w_next2 = gl.load(W + gl.minimum(kt_start + 1, kt_end - 1).to(gl.int64) * tile_words + w_off)
            z_next = gl.load(Z + kt_start * stride_sg + offs_zn)
            s_next = gl.load(S + kt_start * stride_sg + offs_sn)
            _pdl_sync(PDL)
            if XPRE:
                xk = x_cols + kt_start * 128
                x0n, x1n, x2n, x3n = _load_x_tile4(xk, bmask)
            else:  # loop-carried but unused
                x0n = gl.zeros([32, BLOCK_M], gl.bfloat16, b_layout)
                x1n = x0n
                x2n = x0n
                x3n = x0n
            for kt in range(kt_start, kt_end):
                if STAGES >= 3:
                    j = kt - kt_start
                    async_copy.wait_group(STAGES - 2)  # tile j has landed (S - 1 + j groups committed so far)
                    words = ring.index(j % STAGES).load(w_layout)
                    kf = gl.minimum(kt + STAGES - 1, kt_end - 1)  # into the slot read in the previous iteration
                    async_copy.async_copy_global_to_shared(ring.index((j + STAGES - 1) % STAGES),
                                                           W + kf.to(gl.int64) * tile_words + w_off)
                    async_copy.commit_group()
                else:
                    words = w_next
                z_cur = z_next
                s_cur = s_next
                if XPRE:
                    x0, x1, x2, x3 = x0n, x1n, x2n, x3n
                else:
                    xk = x_cols + kt * 128
                    x0, x1, x2, x3 = _load_x_tile4(xk, bmask)
                kn = gl.minimum(kt + 1, kt_end - 1)  # the last iteration re-reads its own tile (an L2 hit)
                if STAGES == 2:
                    w_next = w_next2
                    w_next2 = gl.load(W + gl.minimum(kt + 2, kt_end - 1).to(gl.int64) * tile_words + w_off)
                elif STAGES == 1:
                    w_next = gl.load(W + kn.to(gl.int64) * tile_words + w_off)
                z_next = gl.load(Z + kn * stride_sg + offs_zn)
                s_next = gl.load(S + kn * stride_sg + offs_sn)
                if XPRE:
                    xk = x_cols + kn * 128
                    x0n, x1n, x2n, x3n = _load_x_tile4(xk, bmask)
                acc = _mma_tile(acc, words, z_cur, s_cur, x0, x1, x2, x3, C, BN, BLOCK_M, mma, a_layout, q_layout)
            if STAGES >= 3:
                async_copy.wait_group(0)  # the clamped copies of the last iterations
            if PDL == 2:
                _gdc_launch_dependents()
            _store_tile(acc, Out, Partials, Counters, pid_n, split, M, N, stride_om, SPLIT_K, BN, BLOCK_M, mma)
