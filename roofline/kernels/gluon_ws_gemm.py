"""Weight-only GEMM for M = 64-256 on Hopper (sm_90) in Gluon, warp-specialized, for INT8 (W8A16) and INT4
(W4A16) codes: the @gluon.jit kernel only, no torch import, so that ``bench/gluon_aot_ws_gemm.py`` can compile it
for sm_90 without a GPU. The launchers are ``roofline.kernels.ws_gemm.w8a16_ws_gemm`` and ``w4a16_ws_gemm``.

INT8: out [M, N] = (x [M, K] @ q [N, K]^T) * scale [N], x bf16 / fp16, q int8 codes (per output channel), fp32
accumulation, the scale in the epilogue (``quant_gemm.ref_w8a16_gemm``'s math). INT4: out = x @ W^T with W = (q -
zero) * scale per group of input channels, dequantized by the converter (``quant_gemm.ref_w4a16_gemm``'s math, the
16-bit tile rounded once), the epilogue only casts.

Why: at M = 128 / 256 on the H200 the Triton swap-AB kernel (the converted codes as ``wgmma``'s register A
operand) took 1.5-1.9x cuBLAS bf16's time a layer, and the same kernel fed a 16-bit weight with no conversion at
all was already 1.17-1.40x (``bench/results/int8-cvt-h200-20261207/``): the loads, the conversion and the MMAs
share the same warps. Here each runs in its own partition (``gl.warp_specialize``), as cuBLAS's and CUTLASS's
Hopper GEMMs run:

- loader (1 warp): TMA copies of the x tile [BLOCK_M, BLOCK_K] and the code tile (INT8 [BLOCK_N, BLOCK_K]; INT4
  the words [BLOCK_K / 8, BLOCK_N] of qweight [K / 8, N]) into a ring of STAGES shared-memory stages (``ready``:
  one mbarrier per stage with the bytes expected); with ``LOADER`` False (``GemmConfig.ws == 2``) the converter
  issues these copies itself, STAGES - 1 tiles ahead, and the MMA gets the loader's registers;
- converter (CVT_WARPS warps): the codes from shared memory into registers, to bf16 / fp16 in PTX (four a
  register: ``prmt`` + ``lop3`` + ``sub.bf16x2``, exact, as ``quant_gemm._int8x4_to_16bit``; INT4: nibbles to
  fp32 by the 2^23 magic, minus the zero point, times the group scale; or, with ``INT4`` 2, in packed 16-bit math,
  the same bits), stored as the 16-bit tile [BLOCK_N, BLOCK_K] in the MMA's swizzled layout (``converted``);
- MMA (the default partition, BLOCK_M / 16 warps): ``warpgroup_mma`` with both operands in shared memory (x as A,
  the converted tile's transposed view as B), async, one group in flight; a stage goes back to the loader
  (``empty``) once its product has completed; then the epilogue (INT8: scale, cast; INT4: cast; masked store).

A stage's 16-bit tile is rewritten only after the copies refilled that stage (the loader's, or with ``LOADER``
False the converter's), which wait for the MMA that read it, so one ``empty`` barrier orders both buffers. Grid: one program per (BLOCK_M, BLOCK_N) output tile and K split, M
tiles fastest (the programs that share a weight tile run together, so its codes come from DRAM once). Split-K
(SPLIT_K > 1, for the projections whose N gives fewer tiles than SMs: o_proj at M = 128 is 32 tiles of 128 x 128)
writes fp32 partial sums; the last split of a tile to arrive sums them in split order (deterministic) in the same
launch.

References: NVIDIA CUTLASS 3.x Hopper warp-specialized GEMM (producer / consumer pipelines); "Machete" mixed-input
GEMM (vLLM, 2024); Frantar et al. 2024 (MARLIN) for the PRMT / LOP3 conversions; PTX ISA 8.x ``wgmma.mma_async``.
"""

from __future__ import annotations


def ws_maxnreg(num_warps: int, cvt_warps: int, loader: bool = True) -> int:
    """The kernel-wide register cap (``maxnreg``) that lets every warp be resident in the SM's 65,536 registers:
    the MMA partition's ``num_warps``, the converter's ``cvt_warps`` and the 1-warp loader, rounded up to whole
    warpgroups of 4 (Triton pads a warp-specialized kernel's warps so, for ``setmaxnreg``: 4 + 4 + 1 launch as 12
    warps, 8 + 4 + 1 as 16), so 168 and 128 registers. Without the rounding the driver refused the launch on the
    H100 (2026-12-07: "threads, Required: 384, Hardware limit: 256" at a cap of 224). Without the loader warp
    (``loader`` False) 4 + 4 and 8 + 4 warps: 255 and 168 registers."""
    warps = -(-(num_warps + cvt_warps + int(loader)) // 4) * 4
    return min(255, 65536 // (32 * warps) // 8 * 8)


try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except ImportError:  # pragma: no cover - Triton without Gluon's Hopper module
    gluon = None


def _int4_pairs_asm(magic: str, op: str) -> str:
    """PTX for ``_int4_words_to_16bit_packed``: word $8 -> its 8 codes, (q - z) * s in 16 bits, as $0..$7 (nibble
    j in $j); $9 the 16-bit magic + z, $10 the scale. ``magic``: the 16-bit pair whose low mantissa bits take a
    nibble (0x43004300 bf16 128, 0x64006400 fp16 1024); ``op``: the packed type (bf16x2, f16x2). Nibbles j and
    j + 4 of the word go through one register: shifted right by 4 j, masked to bits 0-3 and 16-19, OR'ed into
    the magic (``lop3`` 0xEA = (a & b) | c)."""
    return ("{ .reg .b32 t0, t1, t2, t3, w1, w2, w3, z2, s2, m, b; mov.b32 z2, {$9, $9}; mov.b32 s2, {$10, $10}; "
            f"mov.b32 m, 0x000F000F; mov.b32 b, {magic}; "
            "shr.u32 w1, $8, 4; shr.u32 w2, $8, 8; shr.u32 w3, $8, 12; "
            "lop3.b32 t0, $8, m, b, 0xEA; lop3.b32 t1, w1, m, b, 0xEA; "
            "lop3.b32 t2, w2, m, b, 0xEA; lop3.b32 t3, w3, m, b, 0xEA; "
            + "".join(f"sub.rn.{op} t{i}, t{i}, z2; " for i in range(4))
            + "".join(f"mul.rn.{op} t{i}, t{i}, s2; " for i in range(4))
            + "mov.b32 {$0, $4}, t0; mov.b32 {$1, $5}, t1; mov.b32 {$2, $6}, t2; mov.b32 {$3, $7}, t3; }")


if gluon is not None:
    _INT4_PAIRS_BF16: gl.constexpr = gl.constexpr(_int4_pairs_asm("0x43004300", "bf16x2"))
    _INT4_PAIRS_F16: gl.constexpr = gl.constexpr(_int4_pairs_asm("0x64006400", "f16x2"))

    @gluon.jit
    def _codes_to_16bit(q, DTYPE: gl.constexpr):
        # int8 codes -> bf16 / fp16, exact, four a 32-bit register (quant_gemm._int8x4_to_16bit's PTX; the fp16 form
        # is gluon_decode_kernels._int8_to_f16x4's, repeated because this module imports nothing from roofline, so
        # that the ahead-of-time check compiles it without torch).
        if DTYPE == gl.bfloat16:
            return gl.inline_asm_elementwise(
                "{ .reg .b32 t, u, a, b, lo, hi, base; mov.b32 lo, 0x007F007F; mov.b32 hi, 0x00800080; "
                "mov.b32 base, 0x43004300; prmt.b32 t, $2, 0, 0x4140; prmt.b32 u, $2, 0, 0x4342; "
                "lop3.b32 a, t, lo, base, 0xEA; lop3.b32 b, t, hi, base, 0xEA; sub.rn.bf16x2 $0, a, b; "
                "lop3.b32 a, u, lo, base, 0xEA; lop3.b32 b, u, hi, base, 0xEA; sub.rn.bf16x2 $1, a, b; }",
                "=r,=r,r", [q], dtype=gl.bfloat16, is_pure=True, pack=4)
        else:
            return gl.inline_asm_elementwise(
                "{ .reg .b32 t, m; xor.b32 t, $2, 0x80808080; mov.b32 m, 0x64806480; "
                "prmt.b32 $0, t, 0x64646464, 0x4140; prmt.b32 $1, t, 0x64646464, 0x4342; "
                "sub.f16x2 $0, $0, m; sub.f16x2 $1, $1, m; }",
                "=r,=r,r", [q], dtype=gl.float16, is_pure=True, pack=4)

    @gluon.jit
    def _w8_loader(x_desc, q_desc, x_smem, q_smem, ready, empty, off_m, off_n, k0, k_tiles,
                   BLOCK_K: gl.constexpr, STAGES: gl.constexpr, INT4: gl.constexpr):
        for i in range(k_tiles):
            _w8_issue(x_desc, q_desc, x_smem, q_smem, ready, empty, off_m, off_n, k0, i, BLOCK_K, STAGES, INT4)

    @gluon.jit
    def _w8_issue(x_desc, q_desc, x_smem, q_smem, ready, empty, off_m, off_n, k0, i, BLOCK_K: gl.constexpr,
                  STAGES: gl.constexpr, INT4: gl.constexpr):
        # TMA copies of tile i's x and codes into stage i % STAGES, once the MMA has released it. The codes: INT8
        # [BLOCK_N, BLOCK_K] of [N, K]; INT4 the words [BLOCK_K / 8, BLOCK_N] of qweight [K / 8, N].
        s = i % STAGES
        # Barriers start in phase 0 not completed: waiting on parity 1 passes at once (the ring starts empty).
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [off_m, (k0 + i) * BLOCK_K], ready.index(s), x_smem.index(s))
        if INT4:
            tma.async_copy_global_to_shared(q_desc, [(k0 + i) * (BLOCK_K // 8), off_n], ready.index(s),
                                            q_smem.index(s))
        else:
            tma.async_copy_global_to_shared(q_desc, [off_n, (k0 + i) * BLOCK_K], ready.index(s), q_smem.index(s))

    @gluon.jit
    def _int4_words_to_16bit(words, sc, zp, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, DTYPE: gl.constexpr):
        # words int32 [BLOCK_K / 8, BLOCK_N] (nibble j of word r: input channel 8 r + j), sc / zp fp32 [BLOCK_N]
        # (the tile's group) -> (q - z) * s [BLOCK_N, BLOCK_K] in DTYPE, as ref_dequantize_int4 in fp32 then
        # rounded: 0x4B000000 | q is the float 2^23 + q, so (2^23 + q) - (2^23 + z) = q - z exactly (z in 0..15).
        zb = (zp + 8388608.0)[None, :]
        s2 = sc[None, :]
        v0 = (((words & 15) | 0x4B000000).to(gl.float32, bitcast=True) - zb) * s2
        v1 = ((((words >> 4) & 15) | 0x4B000000).to(gl.float32, bitcast=True) - zb) * s2
        v2 = ((((words >> 8) & 15) | 0x4B000000).to(gl.float32, bitcast=True) - zb) * s2
        v3 = ((((words >> 12) & 15) | 0x4B000000).to(gl.float32, bitcast=True) - zb) * s2
        v4 = ((((words >> 16) & 15) | 0x4B000000).to(gl.float32, bitcast=True) - zb) * s2
        v5 = ((((words >> 20) & 15) | 0x4B000000).to(gl.float32, bitcast=True) - zb) * s2
        v6 = ((((words >> 24) & 15) | 0x4B000000).to(gl.float32, bitcast=True) - zb) * s2
        v7 = ((((words >> 28) & 15) | 0x4B000000).to(gl.float32, bitcast=True) - zb) * s2
        # [KW, BN, a, b, c] holds nibble j = a + 2 b + 4 c -> [BN, KW, c, b, a] -> [BN, BLOCK_K] (channel 8 r + j)
        w = gl.join(gl.join(gl.join(v0.to(DTYPE), v1.to(DTYPE)), gl.join(v2.to(DTYPE), v3.to(DTYPE))),
                    gl.join(gl.join(v4.to(DTYPE), v5.to(DTYPE)), gl.join(v6.to(DTYPE), v7.to(DTYPE))))
        w = gl.permute(w, (1, 0, 4, 3, 2))
        return gl.reshape(w, [BLOCK_N, BLOCK_K])

    @gluon.jit
    def _int4_words_to_16bit_packed(words, sc, zp, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                                    DTYPE: gl.constexpr):
        # As _int4_words_to_16bit in packed 16-bit math, two codes an instruction (Marlin's LOP3 magic): a nibble
        # pair (j, j + 4) of a word OR'ed into 0x4300 (bf16 128) / 0x6400 (fp16 1024) halves is the pair 128 + q
        # (1024 + q), exact; minus 128 + z, exact (an integer in -15..15); times the scale, one rounding of an
        # exact product, as the fp32 form's product rounded to DTYPE: the same bits. About 2 instructions a code
        # against the fp32 form's ~7. The launcher's default (``ws_gemm.w4a16_ws_gemm(int4_packed=True)``).
        if DTYPE == gl.bfloat16:
            asm: gl.constexpr = _INT4_PAIRS_BF16
            w2, zb = gl.broadcast(words, (zp + 128.0).to(DTYPE)[None, :])
        else:
            asm: gl.constexpr = _INT4_PAIRS_F16
            w2, zb = gl.broadcast(words, (zp + 1024.0).to(DTYPE)[None, :])
        w2, s2 = gl.broadcast(words, sc.to(DTYPE)[None, :])
        dt = zb.dtype
        v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
            asm, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [w2, zb, s2], dtype=(dt, dt, dt, dt, dt, dt, dt, dt), is_pure=True,
            pack=1)
        w = gl.join(gl.join(gl.join(v0, v1), gl.join(v2, v3)), gl.join(gl.join(v4, v5), gl.join(v6, v7)))
        w = gl.permute(w, (1, 0, 4, 3, 2))
        return gl.reshape(w, [BLOCK_N, BLOCK_K])

    @gluon.jit
    def _int4_group(S, Z, N, off_n, kt, GROUP, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                    CVT_WARPS: gl.constexpr):
        # The scales and zero points (fp32 [BLOCK_N]) of K tile kt's group (GROUP a multiple of BLOCK_K; S, Z
        # [K / GROUP, N] in x's dtype), in the layout of the converter's words (4 consecutive columns a thread).
        wl: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [CVT_WARPS, 1], [1, 0])
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, wl))
        g = (kt * BLOCK_K) // GROUP
        sc = gl.load(S + g * N + cols, mask=cols < N, other=0.0).to(gl.float32)
        zp = gl.load(Z + g * N + cols, mask=cols < N, other=0.0).to(gl.float32)
        return sc, zp

    @gluon.jit
    def _w8_convert(q_smem, w_smem, ready, converted, i, sc, zp, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                    STAGES: gl.constexpr, CVT_WARPS: gl.constexpr, INT4: gl.constexpr):
        # Tile i's codes -> 16-bit tile in the MMA's layout. INT8: 64 rows at a time (16 consecutive codes of a row
        # a thread: one 16-byte shared-memory read; ~50 registers, not ~100 at BLOCK_N 256), every slice's codes
        # read before the first converted slice is stored (the compiler keeps a shared-memory read after a store
        # to another buffer, so otherwise each slice waits out the previous one's store: 1-8% slower on the H100,
        # bench/results/ws-variants-h100-20261207/). INT4:
        # the words [BLOCK_K / 8, BLOCK_N] (4 consecutive columns a thread), dequantized with sc / zp
        # (``_int4_group`` of this tile).
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        if INT4:
            wl: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [CVT_WARPS, 1], [1, 0])
            words = q_smem.index(s).load(wl)
            if INT4 == 2:
                w_smem.index(s).store(_int4_words_to_16bit_packed(words, sc, zp, BLOCK_N, BLOCK_K, w_smem.dtype))
            else:
                w_smem.index(s).store(_int4_words_to_16bit(words, sc, zp, BLOCK_N, BLOCK_K, w_smem.dtype))
        else:
            layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (BLOCK_K // 16), BLOCK_K // 16], [CVT_WARPS, 1],
                                                    [1, 0])
            if BLOCK_N == 128:
                q0 = q_smem.index(s).slice(0, 64).load(layout)
                q1 = q_smem.index(s).slice(64, 64).load(layout)
                w_smem.index(s).slice(0, 64).store(_codes_to_16bit(q0, w_smem.dtype))
                w_smem.index(s).slice(64, 64).store(_codes_to_16bit(q1, w_smem.dtype))
            elif BLOCK_N == 256:
                q0 = q_smem.index(s).slice(0, 64).load(layout)
                q1 = q_smem.index(s).slice(64, 64).load(layout)
                q2 = q_smem.index(s).slice(128, 64).load(layout)
                q3 = q_smem.index(s).slice(192, 64).load(layout)
                w_smem.index(s).slice(0, 64).store(_codes_to_16bit(q0, w_smem.dtype))
                w_smem.index(s).slice(64, 64).store(_codes_to_16bit(q1, w_smem.dtype))
                w_smem.index(s).slice(128, 64).store(_codes_to_16bit(q2, w_smem.dtype))
                w_smem.index(s).slice(192, 64).store(_codes_to_16bit(q3, w_smem.dtype))
            else:  # BLOCK_N 64: one slice
                for r in gl.static_range(0, BLOCK_N, 64):
                    q = q_smem.index(s).slice(r, 64).load(layout)
                    w_smem.index(s).slice(r, 64).store(_codes_to_16bit(q, w_smem.dtype))
        fence_async_shared()  # the generic-proxy stores before the MMA's async-proxy reads
        gl.thread_barrier()
        mbarrier.arrive(converted.index(s), count=1)

    @gluon.jit
    def _w8_converter(x_desc, q_desc, x_smem, q_smem, w_smem, ready, empty, converted, off_m, off_n, k0, k_tiles,
                      S, Z, N, GROUP, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                      CVT_WARPS: gl.constexpr, INT4: gl.constexpr, ISSUE: gl.constexpr):
        # Converts tiles 0..k_tiles-1. ISSUE (no loader warp: 4 + 8 warps launch as 12, so the MMA gets 168
        # registers, which a 128 x 256 tile's 128-register accumulator needs): this partition also issues the TMA
        # copies, STAGES - 1 tiles ahead; tile i + STAGES - 1's after tile i is converted, once the MMA has released
        # its stage (product i - 1 done), so the conversion of tile i + 1 overlaps product i. INT4: the next tile's
        # group scales and zero points are loaded (global memory) before this tile's conversion, so their latency
        # hides behind it instead of stalling every tile (INT4 gate_up at M = 128, 128 x 256 tiles: 116.7 ->
        # 103.9 us on the H100).
        if ISSUE:
            for j in gl.static_range(STAGES - 1):
                if j < k_tiles:
                    _w8_issue(x_desc, q_desc, x_smem, q_smem, ready, empty, off_m, off_n, k0, j, BLOCK_K, STAGES,
                              INT4)
        if INT4:
            sc, zp = _int4_group(S, Z, N, off_n, k0, GROUP, BLOCK_N, BLOCK_K, CVT_WARPS)
            for i in range(k_tiles):
                sc_next, zp_next = _int4_group(S, Z, N, off_n, k0 + gl.minimum(i + 1, k_tiles - 1), GROUP, BLOCK_N,
                                               BLOCK_K, CVT_WARPS)
                _w8_convert(q_smem, w_smem, ready, converted, i, sc, zp, BLOCK_N, BLOCK_K, STAGES, CVT_WARPS, INT4)
                sc, zp = sc_next, zp_next
                if ISSUE:
                    if i + STAGES - 1 < k_tiles:
                        _w8_issue(x_desc, q_desc, x_smem, q_smem, ready, empty, off_m, off_n, k0, i + STAGES - 1,
                                  BLOCK_K, STAGES, INT4)
        else:
            for i in range(k_tiles):
                _w8_convert(q_smem, w_smem, ready, converted, i, S, S, BLOCK_N, BLOCK_K, STAGES, CVT_WARPS, INT4)
                if ISSUE:
                    if i + STAGES - 1 < k_tiles:
                        _w8_issue(x_desc, q_desc, x_smem, q_smem, ready, empty, off_m, off_n, k0, i + STAGES - 1,
                                  BLOCK_K, STAGES, INT4)

    @gluon.jit
    def _w8_mma(x_smem, w_smem, ready, converted, empty, S, Out, P, C, M, N, off_m, off_n, tile, split, k_tiles,
                stride_om,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr,
                num_warps: gl.constexpr, INT4: gl.constexpr):
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        for i in range(k_tiles):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)  # x's TMA copy (the converter saw it too)
            mbarrier.wait(converted.index(s), (i // STAGES) & 1)
            acc = warpgroup_mma(x_smem.index(s), w_smem.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # product i - 1 has completed
            if i > 0:
                gl.thread_barrier()
                mbarrier.arrive(empty.index((i - 1) % STAGES), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        if SPLIT_K == 1:
            if INT4:  # the converter applied the group scales
                out = acc
            else:
                out = acc * gl.load(S + cols, mask=cols < N, other=0.0)[None, :]
            ptrs = Out + rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
            gl.store(ptrs, out.to(Out.dtype.element_ty), mask=mask)
        else:
            # This split's fp32 partial sums into P [SPLIT_K, M, N]; the tile's last split to arrive (an acq_rel
            # counter per output tile) sums all SPLIT_K in split order (deterministic), scales, stores, and re-arms
            # the counter: one launch, as quant_gemm's Triton split-K (splitk._splitk_epilogue).
            mn = rows.to(gl.int64)[:, None] * N + cols[None, :]
            gl.store(P + split.to(gl.int64) * M * N + mn, acc, mask=mask)
            gl.thread_barrier()  # every warp of this partition has stored its part of the tile
            arrived = gl.atomic_add(C + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
                for sp in gl.static_range(SPLIT_K):
                    total += gl.load(P + sp * M * N + mn, mask=mask, other=0.0, cache_modifier=".cg")
                if not INT4:
                    total = total * gl.load(S + cols, mask=cols < N, other=0.0)[None, :]
                ptrs = Out + rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
                gl.store(ptrs, total.to(Out.dtype.element_ty), mask=mask)
                gl.atomic_xchg(C + tile, 0)

    @gluon.jit
    def gluon_ws_gemm_kernel(x_desc, q_desc, S, Out, P, C, M, N, K, stride_om, k_per_split,
                              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                              STAGES: gl.constexpr, SPLIT_K: gl.constexpr, CVT_WARPS: gl.constexpr,
                              CVT_REGS: gl.constexpr, W_LAYOUT: gl.constexpr, num_warps: gl.constexpr,
                              LOADER: gl.constexpr = True, Z=None, GROUP=0, INT4: gl.constexpr = 0):
        """x_desc: TMA descriptor of x [M, K] (bf16 / fp16, block [BLOCK_M, BLOCK_K]); q_desc: of the codes [N, K]
        int8 (block [BLOCK_N, BLOCK_K]); S: float32 [N] channel scales; Out: [M, N] in x's dtype, row stride
        stride_om; P: float32 [SPLIT_K, M, N] partial sums when SPLIT_K > 1; C: int32 arrival counters, one per
        output tile, zero (the kernel leaves them zero); k_per_split: K tiles of BLOCK_K per split (no split empty);
        W_LAYOUT: the NVMMA shared layout of a [BLOCK_N, BLOCK_K] 16-bit tile. Grid
        (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), SPLIT_K); num_warps = BLOCK_M // 16 (the MMA partition). LOADER
        False: no loader warp, the converter issues the copies (``GemmConfig.ws == 2``). INT4 (W4A16, the same
        partitions): q_desc over qweight int32 [K / 8, N] (block [BLOCK_K / 8, BLOCK_N]), S and Z the group scales
        and zero points [K / GROUP, N] in x's dtype, applied by the converter (GROUP a multiple of BLOCK_K); the
        epilogue then only casts. INT4 1: the dequantization in fp32; 2: in packed 16-bit math (the same bits)."""
        pid = gl.program_id(0)
        split = gl.program_id(1)
        num_m = gl.cdiv(M, BLOCK_M)
        off_m = (pid % num_m) * BLOCK_M
        off_n = (pid // num_m) * BLOCK_N
        k0 = split * k_per_split
        k_tiles = gl.minimum(k_per_split, gl.cdiv(K, BLOCK_K) - k0)
        x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        if INT4:
            q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_K // 8, BLOCK_N], q_desc.layout)
        else:
            q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], q_desc.layout)
        w_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], W_LAYOUT)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        converted = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(converted.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        if LOADER:
            gl.warp_specialize([
                (_w8_mma, (x_smem, w_smem, ready, converted, empty, S, Out, P, C, M, N, off_m, off_n, pid, split,
                           k_tiles, stride_om, BLOCK_M, BLOCK_N, STAGES, SPLIT_K, num_warps, INT4)),
                (_w8_converter, (x_desc, q_desc, x_smem, q_smem, w_smem, ready, empty, converted, off_m, off_n, k0,
                                 k_tiles, S, Z, N, GROUP, BLOCK_N, BLOCK_K, STAGES, CVT_WARPS, INT4, False)),
                (_w8_loader, (x_desc, q_desc, x_smem, q_smem, ready, empty, off_m, off_n, k0, k_tiles, BLOCK_K,
                              STAGES, INT4)),
            ], [CVT_WARPS, 1], [CVT_REGS, 24])
        else:
            gl.warp_specialize([
                (_w8_mma, (x_smem, w_smem, ready, converted, empty, S, Out, P, C, M, N, off_m, off_n, pid, split,
                           k_tiles, stride_om, BLOCK_M, BLOCK_N, STAGES, SPLIT_K, num_warps, INT4)),
                (_w8_converter, (x_desc, q_desc, x_smem, q_smem, w_smem, ready, empty, converted, off_m, off_n, k0,
                                 k_tiles, S, Z, N, GROUP, BLOCK_N, BLOCK_K, STAGES, CVT_WARPS, INT4, True)),
            ], [CVT_WARPS], [CVT_REGS])
