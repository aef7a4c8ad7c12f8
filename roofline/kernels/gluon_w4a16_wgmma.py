"""INT4 (W4A16) GEMM for M = 8-64 on Hopper (sm_90) in Gluon: the weights dequantized in registers straight into
``wgmma``'s register A operand, the activations staged once per k-tile in shared memory as its B operand.

Why, beside :mod:`roofline.kernels.gluon_w4a16` (``mma.sync``): there every warp loads its own copy of the
activations' B fragments from L2 (at M = 64 that is 4 x 16 KB per 8 KB k-tile of weights, and 128 registers a
thread), and ``mma.sync`` runs at part of the tensor cores' Hopper rate. Here x^T is loaded once per program and
k-tile into a double-buffered shared-memory slab that ``warpgroup_mma`` reads directly (vLLM's Machete kernel
makes the same choice: weights as the register operand, activations from shared memory).

The weights keep the *mma layout* of ``w4a16_mma.repack_int4_mma`` (one layout serves both kernels): a thread's
word for (row n, k32 block, lane column t) holds input channels ``8 t + j`` (j = 0..7) of the block. ``wgmma``'s
register A operand (``k_width = 2``) wants lane column t to hold positions ``r = 16 kb + 8 hi + 2 t + lo`` of a
k32 block, so the activations are stored permuted: shared-memory position r holds channel
``pi(r) = 8 t + 4 kb + 2 hi + lo``, exactly the channel the thread's register at position r came from. The dot
product over a k32 block is a sum over positions, so the permutation cancels.

Per k-tile (128 channels): the words of the next tile, its scales and zero points, and the next x tile (into
registers) are loaded before this tile's math; four k32 ``wgmma`` (async, one wait) accumulate into a zeroed fp32
tile, which is scaled by the group scale into the output accumulator (so products ``x * (q - z)`` stay exact, as
in the ``mma.sync`` kernel); then the next x tile is stored to the other buffer, fenced, and the warps meet.

This module imports no torch (it compiles ahead of time for sm_90: ``bench/gluon_aot_w4a16.py``);
``roofline.kernels.w4a16_mma.w4a16_mma_gemm`` launches it for a config with ``wgmma=True``.

References: PTX ISA 8.x, ``wgmma.mma_async`` register-A fragment layout; NVIDIA CUTLASS "Machete" mixed-input
GEMM (vLLM, 2024); Frantar et al. 2024 (MARLIN) for the LOP3 exponent-magic dequantization.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from roofline.kernels.gluon_w4a16 import (
        _dequant8,
        _gdc_launch_dependents,
        _pdl_sync,
        _split_tile,
        _store_tile,
        _tile_offsets,
    )
except ImportError:  # pragma: no cover - Triton without Gluon's Hopper module
    gluon = None

if gluon is not None:

    @gluon.jit
    def _a_fragment_v3(w, zz, BN: gl.constexpr, A_LAYOUT: gl.constexpr):
        # w int32 [BN / 16, 2, 8, 4] (c, h, g, t): one k32 block's words of rows n = 16 c + 8 h + g; zz the matching
        # (128 + z) pairs -> bf16 [BN, 32] (q - z) at positions r = 16 kb + 8 hi + 2 t + lo, where channel
        # 8 t + j with j = lo + 2 hi + 4 kb sits, in wgmma's register A layout (no data movement).
        v0, v1, v2, v3, v4, v5, v6, v7 = _dequant8(w, zz)
        a = gl.join(gl.join(gl.join(v0, v1), gl.join(v2, v3)), gl.join(gl.join(v4, v5), gl.join(v6, v7)))
        # [c, h, g, t, lo, hi, kb] -> [c, h, g, kb, hi, t, lo]
        a = gl.permute(a, (0, 1, 2, 6, 5, 3, 4))
        a = gl.reshape(a, [BN, 32])
        return gl.convert_layout(a, A_LAYOUT, assert_trivial=True)

    @gluon.jit
    def _tile_fragments(words, z_next, C: gl.constexpr, BN: gl.constexpr, Q_LAYOUT: gl.constexpr,
                        A_LAYOUT: gl.constexpr):
        # a k-tile's words [C, 2, 8, 4, 4] and zero points -> its four k32 A fragments (bf16 [BN, 32], q - z)
        w0, w1, w2, w3, zz = _split_tile(words, z_next)
        a0 = _a_fragment_v3(gl.convert_layout(w0, Q_LAYOUT, assert_trivial=True), zz, BN, A_LAYOUT)
        a1 = _a_fragment_v3(gl.convert_layout(w1, Q_LAYOUT, assert_trivial=True), zz, BN, A_LAYOUT)
        a2 = _a_fragment_v3(gl.convert_layout(w2, Q_LAYOUT, assert_trivial=True), zz, BN, A_LAYOUT)
        a3 = _a_fragment_v3(gl.convert_layout(w3, Q_LAYOUT, assert_trivial=True), zz, BN, A_LAYOUT)
        return a0, a1, a2, a3

    @gluon.jit
    def _issue_wgmma(a0, a1, a2, a3, x_smem, buf, BN: gl.constexpr, BLOCK_M: gl.constexpr,
                     ACC_LAYOUT: gl.constexpr):
        # the tile's four k32 products from slabs 4 buf .. 4 buf + 3, async, into a fresh fp32 accumulator
        accg = gl.zeros([BN, BLOCK_M], gl.float32, ACC_LAYOUT)
        accg = warpgroup_mma(a0, x_smem.index(4 * buf + 0).permute((1, 0)), accg, use_acc=False, is_async=True)
        accg = warpgroup_mma(a1, x_smem.index(4 * buf + 1).permute((1, 0)), accg, is_async=True)
        accg = warpgroup_mma(a2, x_smem.index(4 * buf + 2).permute((1, 0)), accg, is_async=True)
        return warpgroup_mma(a3, x_smem.index(4 * buf + 3).permute((1, 0)), accg, is_async=True)

    @gluon.jit
    def _load_x_tile(x_rows, kt, xmask):
        # x^T's k-tile kt, permuted for the slab: x_rows [4 (slab), BM, 32 (position r)] pointers at column pi(r)
        return gl.load(x_rows + kt * 128, mask=xmask, other=0.0)

    @gluon.jit
    def _store_x_tile(x_smem, buf, x):
        # x [4, BM, 32] -> slabs 4 buf .. 4 buf + 3
        x01, x23 = gl.split(gl.permute(gl.reshape(x, [2, 2, x.shape[1], 32]), (1, 2, 3, 0)))
        x0, x1 = gl.split(gl.permute(x01, (1, 2, 0)))
        x2, x3 = gl.split(gl.permute(x23, (1, 2, 0)))
        x_smem.index(4 * buf).store(x0)
        x_smem.index(4 * buf + 1).store(x1)
        x_smem.index(4 * buf + 2).store(x2)
        x_smem.index(4 * buf + 3).store(x3)

    @gluon.jit
    def _w4a16_wgmma_kernel(
        X, W, S, Z, Out, Partials, Counters,
        M, N, K, k_tiles_per_split, SPLIT_K,
        stride_xm, stride_sg, stride_om,
        BLOCK_M: gl.constexpr, BN: gl.constexpr, NUM_WARPS: gl.constexpr, PDL: gl.constexpr = 0,
        PIPE: gl.constexpr = 1,
    ):
        # out^T [N, M] = W [N, K] @ x^T [K, M]; X bf16 [M, K] (M <= BLOCK_M, BLOCK_M in 8..64 a multiple of 8),
        # W int32 [K / 128, N * 16] (mma layout), S, Z bf16 [K / 128, N], Out bf16 [M, N], Partials fp32
        # [SPLIT_K, M, N], Counters int32 [N / BN]. Grid (N / BN, SPLIT_K); NUM_WARPS 4 or 8 (one or two
        # warpgroups); BN a multiple of 16 * NUM_WARPS (each warpgroup takes 64-row blocks). PDL as the mma kernel.
        # PIPE: 1, one k-tile at a time; 2, two k-tiles a loop body, the second dequantized while the first's
        # products run (no fragment of a running wgmma crosses the loop's back edge: the register allocator
        # would reuse its registers, docs/kernels.md).
        pid_n = gl.program_id(0)
        split = gl.program_id(1)
        C: gl.constexpr = BN // 16
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                             instr_shape=[16, BLOCK_M, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        w_layout: gl.constexpr = gl.BlockedLayout([1, 2, 1, 1, 4], [1, 1, 8, 4, 1], [NUM_WARPS, 1, 1, 1, 1],
                                                  [4, 1, 3, 2, 0])
        q_layout: gl.constexpr = gl.BlockedLayout([1, 2, 1, 1], [1, 1, 8, 4], [NUM_WARPS, 1, 1, 1], [1, 3, 2, 0])
        x_layout: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 2, 16], [1, NUM_WARPS, 1], [2, 1, 0])
        x_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 32], gl.bfloat16)

        w_off, offs_zn = _tile_offsets(pid_n * BN, BN, w_layout, q_layout)
        tile_words = 16 * N
        offs_sn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_layout))

        # x^T slabs: [4 (k32 block i), BLOCK_M, 32 (position r)] at column 128 kt + 32 i + pi(r)
        xi = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, x_layout)))
        xm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(2, x_layout)))
        xr = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, x_layout)))
        pi = 8 * ((xr // 2) % 4) + 4 * (xr // 16) + 2 * ((xr // 8) % 2) + xr % 2
        x_rows = X + xm[None, :, None].to(gl.int64) * stride_xm + xi[:, None, None] * 32 + pi[None, None, :]
        xmask = (xm < M)[None, :, None]
        # two buffers of 4 slabs: slab 4 b + i holds k32 block i of the tile in buffer b
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [8, BLOCK_M, 32], x_smem_layout)

        k_tiles = K // 128
        kt_start = split * k_tiles_per_split
        kt_end = gl.minimum(kt_start + k_tiles_per_split, k_tiles)
        acc = gl.zeros([BN, BLOCK_M], gl.float32, acc_layout)
        w_next = gl.load(W + kt_start.to(gl.int64) * tile_words + w_off)
        z_next = gl.load(Z + kt_start * stride_sg + offs_zn)
        s_next = gl.load(S + kt_start * stride_sg + offs_sn)
        _pdl_sync(PDL)
        _store_x_tile(x_smem, 0, _load_x_tile(x_rows, kt_start, xmask))
        fence_async_shared()
        gl.thread_barrier()
        if PIPE == 2:
            for kp in range(kt_start, kt_end, 2):
                # tiles kp (x in buffer 0) and k1 = kp + 1 (its products discarded past the end)
                k1 = gl.minimum(kp + 1, kt_end - 1)
                k2 = gl.minimum(kp + 2, kt_end - 1)
                words0 = w_next
                z0 = z_next
                s0 = s_next.to(gl.float32)
                words1 = gl.load(W + k1.to(gl.int64) * tile_words + w_off)
                z1 = gl.load(Z + k1 * stride_sg + offs_zn)
                s1 = gl.load(S + k1 * stride_sg + offs_sn).to(gl.float32) * (kp + 1 < kt_end).to(gl.float32)
                x1 = _load_x_tile(x_rows, k1, xmask)
                w_next = gl.load(W + k2.to(gl.int64) * tile_words + w_off)
                z_next = gl.load(Z + k2 * stride_sg + offs_zn)
                s_next = gl.load(S + k2 * stride_sg + offs_sn)
                x2 = _load_x_tile(x_rows, k2, xmask)
                a0, a1, a2, a3 = _tile_fragments(words0, z0, C, BN, q_layout, a_layout)
                acc0 = _issue_wgmma(a0, a1, a2, a3, x_smem, 0, BN, BLOCK_M, acc_layout)
                # buffer 1 was last read by the previous body's second tile, waited for there (and the barrier
                # at the end of that body)
                _store_x_tile(x_smem, 1, x1)
                fence_async_shared()
                gl.thread_barrier()
                b0, b1, b2, b3 = _tile_fragments(words1, z1, C, BN, q_layout, a_layout)
                acc0, a0, a1, a2, a3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, a0, a1, a2, a3))
                acc += acc0 * s0[:, None]
                acc1 = _issue_wgmma(b0, b1, b2, b3, x_smem, 1, BN, BLOCK_M, acc_layout)
                gl.thread_barrier()  # every warpgroup is done with buffer 0 (tile kp)
                _store_x_tile(x_smem, 0, x2)
                fence_async_shared()
                acc1, b0, b1, b2, b3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, b0, b1, b2, b3))
                acc += acc1 * s1[:, None]
                gl.thread_barrier()  # x tile kp + 2 is stored and fenced by every thread
        else:
            for kt in range(kt_start, kt_end):
                buf = (kt - kt_start) % 2
                words = w_next
                z_cur = z_next
                s = s_next.to(gl.float32)
                kn = gl.minimum(kt + 1, kt_end - 1)  # the last iteration re-reads its own tile (an L2 hit)
                w_next = gl.load(W + kn.to(gl.int64) * tile_words + w_off)
                z_next = gl.load(Z + kn * stride_sg + offs_zn)
                s_next = gl.load(S + kn * stride_sg + offs_sn)
                x_next = _load_x_tile(x_rows, kn, xmask)

                a0, a1, a2, a3 = _tile_fragments(words, z_cur, C, BN, q_layout, a_layout)
                accg = _issue_wgmma(a0, a1, a2, a3, x_smem, buf, BN, BLOCK_M, acc_layout)
                # the A fragments' registers must live until the products that read them have landed
                accg, a0, a1, a2, a3 = warpgroup_mma_wait(num_outstanding=0, deps=(accg, a0, a1, a2, a3))
                acc += accg * s[:, None]
                # the other buffer was last read by the previous iteration's wgmma, which every warp has waited for
                # (the barrier below, one iteration ago)
                _store_x_tile(x_smem, 1 - buf, x_next)
                fence_async_shared()
                gl.thread_barrier()
        if PDL == 2:
            _gdc_launch_dependents()
        _store_tile(acc, Out, Partials, Counters, pid_n, split, M, N, stride_om, SPLIT_K, BN, BLOCK_M, acc_layout)
