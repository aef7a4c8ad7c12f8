"""GEMMs for quantized linear layers in Triton: weight-only INT4 / INT8 (w4a16, w8a16), INT8 W8A8
(SmoothQuant-style, per-token activation scales), the per-token INT8 activation quantizer, dequantize
kernels for the "dequantize, then dense cuBLAS GEMM" path, and a dense split-K small-M GEMV.

Every GEMM computes ``out [M, N] = x [M, K] @ W^T`` with ``W`` the logical ``[N, K]`` weight
(``out_features, in_features``), fp32 accumulation (int32 for INT8 x INT8), output in the activation dtype.
Each public kernel has a pure-torch ``ref_`` twin on the same layouts (fp32 math, one cast at the end).

Kernel weight layouts (made once at load time by ``prepare_*`` from the canonical forms of
``roofline.quant.quantize``; CPU or CUDA tensors):

- INT4 (:class:`Int4Packed`, from ``Int4Weight``), GPTQ-style packing along K:

  - ``qweight`` int32 ``[K // 8, N]``: bits ``4i .. 4i+3`` of word ``[r, n]`` hold ``q[n, 8r + i]`` (0..15).
  - ``scales`` ``[K // G, N]`` in the activation dtype (rounded once from the canonical float32).
  - ``zeros`` ``[K // G, N]`` in the activation dtype (the integer zero points 0..15, exact in any float).

  ``W[n, k] = (q - zeros[k // G, n]) * scales[k // G, n]``; groups are contiguous (``k // G``). Act-order
  (GPTQ ``g_idx``) weights are handled by the caller permuting input channels first (``prepare_int4``
  refuses a non-trivial ``g_idx``). Bytes: ``K*N/2 + 2 * (K/G) * N * itemsize`` (:func:`int4_weight_bytes`;
  Llama-3-8B gate_up at G=128, bf16: 58.7 MB + 1.8 MB).
- INT8 (:class:`Int8Packed`, from ``ChannelWeight``): the canonical ``q`` int8 ``[N, K]`` (K contiguous)
  and ``scales`` float32 ``[N]``, ``W[n, k] = q[n, k] * scales[n]``. The same tensor serves w8a16, the
  W8A8 ``int8_gemm`` (int8 tensor-core dots want K-major B, i.e. ``[N, K]``), ``torch._int_mm`` (as the
  column-major ``q.t()``) and the CPU path ``torch._weight_int8pack_mm``. Bytes: ``N*K + 4*N``.

Variants, picked by M from an explicit table (:data:`CONFIGS`; no autotuning, so a CUDA-graph capture
at a new M never benchmarks):

- small M (M <= 16): a bandwidth-bound stream over the weight. Rows of x are padded to 16 for ``tl.dot``
  (the tensor cores have throughput to spare), BLOCK_N is narrow so there are many programs, and K is
  split (``SPLIT_K``, :func:`choose_split_k`) when the N tiles alone give fewer than ~4 programs per SM.
  Split-K partials are fp32 ``[SPLIT_K, M, N]``; the last program of a tile to finish (a per-tile arrival
  counter, atomics with acquire-release semantics) sums them in split order and writes the output, so the
  reduction is deterministic and there is one launch. The counters are reset by that program, so they
  stay zero between calls (CUDA-graph safe; kernels that share them must be stream-ordered). For INT4 the
  group scale is applied after each tile's dot (``acc += dot(x, q - z) * s``, BLOCK_K divides G), so
  the per-element work is a shift, a mask/or (``q | 0x4B000000`` is the float ``2^23 + q``, no int->float
  convert), a subtract and a cast.
- larger M: a tiled ``tl.dot`` GEMM (grouped tile order for L2 reuse), dequantizing each [BLOCK_K,
  BLOCK_N] weight tile in registers (``(q - z) * s`` rounded once to the activation dtype, as
  ``Int4Weight.dequantize(dtype)`` with the prepared scales).

References: GPTQ packing (Frantar et al. 2022, "GPTQ", and the AutoGPTQ/GPTQ-for-LLaMa kernels); split-K
for skinny W4A16 GEMMs (Hoque, Wright et al., PyTorch blog 2024, "Accelerating a Triton fused kernel for
W4A16 quantized inference with SplitK work decomposition"); SmoothQuant W8A8 with per-token activation
and per-channel weight scales (Xiao et al. 2023); the float magic-number conversion (``2^23 + i`` has i in
its low mantissa bits, IEEE 754 binary32) as in FasterTransformer's int4 converters.
"""

from __future__ import annotations

import functools
import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

from roofline.kernels import pdl
from roofline.kernels.splitk import arrival_counters as _counters

# isort: off
from roofline.kernels.act_quant import (  # noqa: F401 - the family, re-exported: callers use quant_gemm.X
    per_token_quant_fp8, per_token_quant_int8, ref_per_token_quant_fp8, ref_per_token_quant_int8)
from roofline.kernels.dequant import (  # noqa: F401 - re-exported
    dequantize_int4, dequantize_int8, ref_dequantize_int4, ref_dequantize_int8)
from roofline.kernels.quant_layouts import (  # noqa: F401 - the layouts and tile table, re-exported
    _GEMV_FALLBACK, _MAGIC, _MIN_SCALE, CONFIGS, FMT_DENSE, FMT_FP8, FMT_FP8_W8A16, FMT_INT4, FMT_INT8,
    FMT_INT8_INT8, SMALL_M, GemmConfig, Int4Packed, Int8Packed, _as_rows, _check_float_act, int4_weight_bytes,
    int8_weight_bytes, pack_int4, pick_config, prepare_int4, prepare_int8, unpack_int4)
# isort: on

# ---------------------------------------------------------------------------------------- pure-torch twins

def ref_w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """Twin of :func:`w4a16_gemm`: fp32 ``x @ W^T`` with W dequantized in fp32, cast to x's dtype."""
    w = ref_dequantize_int4(qweight, scales, zeros, group_size, torch.float32)
    return (x.float() @ w.t()).to(x.dtype)


def ref_w8a16_gemm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`w8a16_gemm`: fp32 ``(x @ q^T) * scales``, cast to x's dtype."""
    return ((x.float() @ q.float().t()) * scales.float()[None, :]).to(x.dtype)


def ref_int8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """Twin of :func:`int8_gemm`: exact integer ``xq @ wq^T`` (in float64, exact while K * 127^2 < 2^53; CUDA has
    no integer matmul), then ``* x_scale * w_scale`` in fp32."""
    acc = (xq.double() @ wq.double().t()).float()
    return (acc * x_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)).to(out_dtype)


def ref_dense_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`dense_gemv`: fp32 ``x @ weight^T``, cast to x's dtype."""
    return (x.float() @ weight.float().t()).to(x.dtype)


# ---------------------------------------------------------------------------------------- Triton kernels

if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _int8x4_to_16bit(w, DTYPE: tl.constexpr):
        # int8 codes -> bf16 / fp16, exact, four a register in PTX (sm_90: sub.bf16x2), where the magic-float path
        # costs a sign extension, an add, a subtract and a cvt per code. bf16: two prmt put the bytes b under zero
        # high bytes; per pair A = 0x4300 | (b & 0x7F) = 128 + low 7 bits and B = 0x4300 | (b & 0x80) = 128, or
        # 256 where the sign bit is set (one lop3 each); A - B = q. fp16: the bytes b ^ 0x80 = q + 128 under the
        # exponent byte 0x64 are 1024 + 128 + q; minus 1152 (0x6480) is q. (MARLIN's LOP3/PRMT magic numbers,
        # Frantar et al. 2024, in 8-bit form.)
        if DTYPE == tl.bfloat16:
            return tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 t, u, a, b, lo, hi, base;
                mov.b32 lo, 0x007F007F;
                mov.b32 hi, 0x00800080;
                mov.b32 base, 0x43004300;
                prmt.b32 t, $2, 0, 0x4140;
                prmt.b32 u, $2, 0, 0x4342;
                lop3.b32 a, t, lo, base, 0xEA;
                lop3.b32 b, t, hi, base, 0xEA;
                sub.rn.bf16x2 $0, a, b;
                lop3.b32 a, u, lo, base, 0xEA;
                lop3.b32 b, u, hi, base, 0xEA;
                sub.rn.bf16x2 $1, a, b;
                }""",
                constraints="=r,=r,r", args=[w], dtype=tl.bfloat16, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 t, m;
                xor.b32 t, $2, 0x80808080;
                mov.b32 m, 0x64806480;
                prmt.b32 $0, t, 0x64646464, 0x4140;
                prmt.b32 $1, t, 0x64646464, 0x4342;
                sub.f16x2 $0, $0, m;
                sub.f16x2 $1, $1, m;
                }""",
                constraints="=r,=r,r", args=[w], dtype=tl.float16, is_pure=True, pack=4)

    @triton.jit
    def _int8_to(w, DTYPE: tl.constexpr, PTX_CVT: tl.constexpr):
        # int8 codes -> DTYPE, exact: in PTX four at a time (PTX_CVT, 16-bit DTYPE on sm_90), else 0x4B000080 + q
        # read as a float is 2^23 + 128 + q (q in [-128, 127]), no I2F.
        if PTX_CVT:
            return _int8x4_to_16bit(w, DTYPE)
        else:
            return ((w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0).to(DTYPE)

    # M and the split length are not specialized (no recompile per batch size inside one M bucket).
    @triton.jit(do_not_specialize=["M", "k_tiles_per_split"])
    def _qgemm_kernel(
        X, W, S, Z, XS, Out, Partials, Counters,
        M, N, K, k_tiles_per_split,
        stride_xm, stride_wr, stride_sg, stride_om,
        FMT: tl.constexpr, GROUP: tl.constexpr, SCALES: tl.constexpr, UNPACK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = 0,
        SWAP_AB: tl.constexpr = 0, PTX_CVT: tl.constexpr = 0,
    ):
        # PDL (sm_90): wait for the previous kernel before the first activation load (the launch, the grid's
        # set-up and its residency overlap that kernel's tail), release the next one after the K loop.
        if PDL:
            gdc_wait()
        # Grouped tile order: GROUP_M row tiles sweep N together, so their weight tiles are reused from L2.
        pid = tl.program_id(0)
        split = tl.program_id(1)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * num_pid_n
        first_m = (pid // width) * GROUP_M
        group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % group_rows
        pid_n = (pid % width) // group_rows

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mmask = offs_m < M
        nmask = offs_n < N
        x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
        if FMT == 3:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
        elif SWAP_AB:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # out^T: the weights are the MMA's A operand
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)

        k_tiles = tl.cdiv(K, BLOCK_K)
        kt_start = split * k_tiles_per_split
        kt_end = tl.minimum(kt_start + k_tiles_per_split, k_tiles)
        for kt in range(kt_start, kt_end):
            ks = kt * BLOCK_K + offs_k  # [BLOCK_K] input channels of this tile
            if EVEN_K:
                x = tl.load(x_rows + ks[None, :], mask=mmask[:, None], other=0)  # [BLOCK_M, BLOCK_K]
            else:
                kmask = ks < K
                x = tl.load(x_rows + ks[None, :], mask=mmask[:, None] & kmask[None, :], other=0)
            if FMT == 1:
                # INT4: codes of [BLOCK_K, BLOCK_N] from int32 words [K // 8, N] (8 consecutive k per word).
                # (K % 8 == 0, so rows past K are whole words: a K-tail tile masks them with ks < K.)
                if UNPACK == 0:
                    # Each row k loads word k // 8 (8 rows share a word: the repeats hit L1).
                    wmask = nmask[None, :] if EVEN_K else nmask[None, :] & kmask[:, None]
                    words = tl.load(W + (ks // 8)[:, None].to(tl.int64) * stride_wr + offs_n[None, :],
                                    mask=wmask, other=0)
                    qi = (words >> ((ks % 8) * 4)[:, None]) & 0xF
                else:
                    # One load per word, [BLOCK_K // 8, BLOCK_N], split into 8 nibbles and reshaped
                    # (row-major: word r, nibble i -> row 8r + i).
                    rows = kt * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
                    rmask = nmask[None, :] if EVEN_K else nmask[None, :] & (rows < K // 8)[:, None]
                    words = tl.load(W + rows[:, None].to(tl.int64) * stride_wr + offs_n[None, :],
                                    mask=rmask, other=0)
                    shifts = tl.arange(0, 8) * 4
                    qi = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 0xF, [BLOCK_K, BLOCK_N])
                # q | 0x4B000000 is the float 2^23 + q exactly: an int->float conversion without I2F.
                qf = (qi | 0x4B000000).to(tl.float32, bitcast=True)
                if SCALES == 2:
                    # BLOCK_K divides GROUP: the tile lies in one group; q - z is an exact small integer.
                    g = (kt * BLOCK_K) // GROUP
                    s = tl.load(S + g * stride_sg + offs_n, mask=nmask, other=0.0).to(tl.float32)
                    z = tl.load(Z + g * stride_sg + offs_n, mask=nmask, other=0.0).to(tl.float32) + 8388608.0
                    w = (qf - z[None, :]).to(x.dtype)
                    acc += tl.dot(x, w, input_precision=DOT_PRECISION) * s[None, :]
                elif SCALES == 1:
                    # BLOCK_K divides GROUP: one (scale, zero) row for the tile, dequantized before the dot
                    # (``(q - z) * s`` rounded once to x's dtype, as Int4Weight.dequantize).
                    g = (kt * BLOCK_K) // GROUP
                    s = tl.load(S + g * stride_sg + offs_n, mask=nmask, other=0.0).to(tl.float32)
                    z = tl.load(Z + g * stride_sg + offs_n, mask=nmask, other=0.0).to(tl.float32) + 8388608.0
                    w = ((qf - z[None, :]) * s[None, :]).to(x.dtype)
                    acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
                else:
                    sg = (ks // GROUP)[:, None] * stride_sg + offs_n[None, :]  # [BLOCK_K, BLOCK_N]
                    smask = nmask[None, :] if EVEN_K else nmask[None, :] & kmask[:, None]
                    s = tl.load(S + sg, mask=smask, other=0.0).to(tl.float32)
                    z = tl.load(Z + sg, mask=smask, other=0.0).to(tl.float32) + 8388608.0
                    w = ((qf - z) * s).to(x.dtype)
                    acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
            elif SWAP_AB:
                # out^T [BLOCK_N, BLOCK_M] += W [BLOCK_N, BLOCK_K] @ x^T: the 8-bit codes are converted in
                # registers straight into the A operand (Hopper's wgmma takes A from registers, B from shared
                # memory), where the unswapped dot stages the converted tile to shared memory again as B; and
                # the output channels fill the MMA's M (64 a warpgroup) while few rows of x fill its N (>= 8).
                wb = W.to(tl.pointer_type(tl.uint8)) if FMT == 5 else W
                w_ptrs = wb + offs_n[:, None].to(tl.int64) * stride_wr + ks[None, :]
                if EVEN_K:
                    w = tl.load(w_ptrs, mask=nmask[:, None], other=0)
                else:
                    w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0)
                if FMT == 5:
                    wf = w.to(tl.float8e4nv, bitcast=True).to(x.dtype)
                else:
                    wf = _int8_to(w, x.dtype, PTX_CVT)
                acc = tl.dot(wf, tl.trans(x), acc, input_precision=DOT_PRECISION)
            else:
                # [N, K] weights (dense, int8, fp8 codes read as bytes): the [BLOCK_K, BLOCK_N] tile of W^T.
                wb = W.to(tl.pointer_type(tl.uint8)) if FMT == 5 else W
                w_ptrs = wb + offs_n[None, :].to(tl.int64) * stride_wr + ks[:, None]
                if EVEN_K:
                    w = tl.load(w_ptrs, mask=nmask[None, :], other=0)
                else:
                    w = tl.load(w_ptrs, mask=nmask[None, :] & kmask[:, None], other=0)
                if FMT == 0:
                    acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
                elif FMT == 5:
                    # FP8 E4M3 weight-only: codes upcast to x's dtype in registers (exact: E4M3 is a subset of
                    # bf16/fp16), the channel scale in the epilogue.
                    acc = tl.dot(x, w.to(tl.float8e4nv, bitcast=True).to(x.dtype), acc, input_precision=DOT_PRECISION)
                elif FMT == 2:
                    acc = tl.dot(x, _int8_to(w, x.dtype, PTX_CVT), acc, input_precision=DOT_PRECISION)
                else:
                    acc = tl.dot(x, w, acc, out_dtype=tl.int32)

        if PDL:
            gdc_launch_dependents()
        if SWAP_AB:
            acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
        # Epilogue: per-channel (and per-token) scales, then store or split-K reduce.
        if FMT == 2 or FMT == 5:
            acc = acc * tl.load(S + offs_n, mask=nmask, other=0.0)[None, :]
        if FMT == 3:
            xs = tl.load(XS + offs_m, mask=mmask, other=0.0)
            ws = tl.load(S + offs_n, mask=nmask, other=0.0)
            acc = acc.to(tl.float32) * xs[:, None] * ws[None, :]
        omask = mmask[:, None] & nmask[None, :]
        out_ptrs = Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=omask)
        else:
            # Partials [SPLIT_K, M, N] fp32. The last program of this tile to arrive sums them in split
            # order (deterministic) and re-arms the tile's counter for the next call.
            mn = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
            tl.store(Partials + split.to(tl.int64) * M * N + mn, acc, mask=omask)
            tl.debug_barrier()  # every thread's partial is issued before the release below
            arrived = tl.atomic_add(Counters + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for sp in tl.static_range(SPLIT_K):
                    total += tl.load(Partials + sp * M * N + mn, mask=omask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptrs, total.to(Out.dtype.element_ty), mask=omask)
                tl.atomic_xchg(Counters + pid, 0)



# ---------------------------------------------------------------------------------------- launchers

@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: small splits still get exercised


def choose_split_k(tiles_mn: int, k_tiles: int, num_sms: int, programs_per_sm: int = 4,
                   max_split: int = 16) -> int:
    """K splits so the grid has about ``programs_per_sm`` programs per SM (a power of two, >= 2 K tiles
    per split, <= ``max_split``); 1 when the output tiles alone fill the GPU.

    Llama-3-8B at M=1, BLOCK_N 32, 132 SMs: qkv (192 tiles) 2, o and down (128) 4, gate_up (896) 1.
    """
    want = math.ceil(programs_per_sm * num_sms / max(1, tiles_mn))
    cap = min(max_split, max(1, k_tiles // 2), want)
    return 1 << (max(1, cap).bit_length() - 1)


def _ptx_cvt(x: torch.Tensor) -> bool:
    """Whether the INT8 codes convert in inline PTX (:func:`_int8x4_to_16bit`): 16-bit x on an sm_90+ GPU, not
    under ``TRITON_INTERPRET`` (which runs no PTX). On by default since 2026-12-07: on the H200 the int8 GPU tests
    pass with it and llama-3-8b int8 decode was 1.02-1.09x faster than with the magic-float conversion at every batch
    from 1 to 256 (``bench/results/int8-cvt-h200-20261207/``); ``ROOFLINE_INT8_PTX_CVT=0`` (read at import) turns it
    off."""
    return _PTX_CVT_ON and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _sm90(x.device.index)


_PTX_CVT_ON = os.environ.get("TRITON_INTERPRET") != "1" and os.environ.get("ROOFLINE_INT8_PTX_CVT", "1") != "0"


@functools.cache
def _sm90(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit operands


def _launch_gemm(fmt: int, table: str, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None,
                 xs: torch.Tensor | None, n: int, group: int, out_dtype: torch.dtype,
                 config: GemmConfig | None, quant_x: bool = False) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("triton is not installed; use the ref_ twins on this machine")
    m, k = x.shape
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = config or pick_config(table, m)
    if cfg.ws:  # the warp-specialized Gluon GEMM where it runs, else the Triton default for M
        if fmt not in (FMT_INT8, FMT_INT4):
            raise ValueError(f"ws is an INT8 / INT4 weight-only config only, got format {fmt}: {cfg}")
        from roofline.kernels import ws_gemm

        int4 = fmt == FMT_INT4
        if ws_gemm.ws_unsupported_reason(x, w, cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages,
                                          group if int4 else None) is None:
            tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
            args = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages, cfg.split_k, _num_sms(x.device),
                    _counters(x.device, tiles))
            if int4:
                return ws_gemm.w4a16_ws_gemm(x, w, s, z, group, *args, loader=cfg.ws != 2)
            return ws_gemm.w8a16_ws_gemm(x, w, s, *args, loader=cfg.ws != 2)
        cfg = pick_config(table, m)
    block_k = cfg.block_k
    scales_mode = 0  # INT4 scales: 0 gathered per element, 1 one row per tile, 2 one row after the dot
    if cfg.gemv and fmt == FMT_INT4:
        # One (scale, zero) row per K tile: BLOCK_K a power of two dividing G, and whole words (>= 8).
        block_k = min(block_k, group & -group)
        if block_k < 8:  # G not a multiple of 8 (a word spans two groups): the tl.dot variant takes it
            cfg, block_k = _GEMV_FALLBACK, _GEMV_FALLBACK.block_k
    if fmt == FMT_INT4:
        # Small M: the group scale after each tile's dot needs BLOCK_K | GROUP (and BLOCK_K >= 16 for tl.dot).
        bk = min(block_k, group)
        if bk >= 16 and group % bk == 0 and bk & (bk - 1) == 0:
            block_k, scales_mode = bk, (2 if cfg.block_m <= SMALL_M else 1)
        if cfg.unpack == 1 and block_k % 8:
            raise ValueError(f"unpack=1 needs BLOCK_K % 8 == 0, got {block_k}")
    k_tiles = triton.cdiv(k, block_k)
    tiles_mn = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = cfg.split_k or choose_split_k(tiles_mn, k_tiles, _num_sms(x.device))
    split = max(1, min(split, k_tiles))
    per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, per_split)  # no empty trailing splits
    if split > 1:
        partials = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = _counters(x.device, tiles_mn)
    else:  # unused, but typed: the GEMV's split-K branch is compiled for every split count (a run-time value)
        partials = torch.empty(1, dtype=torch.float32, device=x.device)
        counters = _counters(x.device, 1)
    launch = pdl.launch_kwargs(x.device, cfg.pdl)
    if cfg.gemv:
        from roofline.kernels.quant_gemv import _gemv_kernel

        _gemv_kernel[(tiles_mn, split)](
            x, w, s, z if z is not None else s, xs if xs is not None else s, out, partials, counters,
            m, n, k, per_split,
            x.stride(0), w.stride(0), z.stride(0) if z is not None else 0, out.stride(0),
            FMT=fmt, GROUP=group, QUANT_X=quant_x, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
            SPLIT_K=split, EVEN_K=k % block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch,
        )
        return out
    if quant_x:
        raise ValueError(f"fused activation quantization is a GEMV config only, got {cfg}")
    if cfg.swap_ab and fmt not in (FMT_INT8, FMT_FP8_W8A16):
        raise ValueError(f"swap_ab is a weight-only 8-bit (int8, fp8 W8A16) config only, got format {fmt}: {cfg}")
    _qgemm_kernel[(tiles_mn, split)](
        x, w, s, z if z is not None else s, xs if xs is not None else s, out, partials, counters,
        m, n, k, per_split,
        x.stride(0), w.stride(0), z.stride(0) if z is not None else 0, out.stride(0),
        FMT=fmt, GROUP=group, SCALES=scales_mode, UNPACK=cfg.unpack,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=8,
        SPLIT_K=split, EVEN_K=k % block_k == 0, DOT_PRECISION=_dot_precision(x.dtype), SWAP_AB=int(cfg.swap_ab),
        PTX_CVT=int(fmt == FMT_INT8 and _ptx_cvt(x)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch,
    )
    return out


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, config: GemmConfig | None = None) -> torch.Tensor:
    """``x @ W^T`` for an INT4 weight in the kernel layout, dequantized in registers.

    Args:
        x: [..., K] float16/bfloat16 (float32 for tests), last dim contiguous.
        qweight: int32 [K // 8, N] (nibble i of word r = code of input channel 8r + i).
        scales, zeros: [K // G, N] in x's dtype, contiguous (zeros: integer values 0..15).
        group_size: G, input channels per group; divides K.
        config: a tile configuration (tests and benchmarks); default by M from :data:`CONFIGS`.

    Returns:
        [..., N] in x's dtype; fp32 accumulation.

    Raises:
        ValueError: shapes, dtypes or group size that disagree. RuntimeError: triton missing.
    """
    k8, n = qweight.shape
    k = k8 * 8
    _check_float_act(x, "w4a16_gemm")
    if qweight.dtype != torch.int32 or k % group_size or scales.shape != (k // group_size, n):
        raise ValueError(f"w4a16_gemm: qweight {tuple(qweight.shape)} {qweight.dtype}, scales "
                         f"{tuple(scales.shape)} and group size {group_size} disagree (want int32 [K/8, N], "
                         f"[K/G, N])")
    if zeros.shape != scales.shape or scales.dtype != x.dtype or zeros.dtype != x.dtype:
        raise ValueError(f"w4a16_gemm: scales/zeros must be {x.dtype} {tuple(scales.shape)}, got "
                         f"{scales.dtype} {tuple(scales.shape)} / {zeros.dtype} {tuple(zeros.shape)}")
    x2 = _as_rows(x, k, "w4a16_gemm")
    out = _launch_gemm(FMT_INT4, "int4", x2, qweight.contiguous(), scales.contiguous(), zeros.contiguous(), None,
                       n, group_size, x.dtype, config)
    return out.view(*x.shape[:-1], n)


def w8a16_gemm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
               config: GemmConfig | None = None) -> torch.Tensor:
    """``x @ W^T`` for a per-channel INT8 weight (``W = q * scales[:, None]``), dequantized in registers.

    Args:
        x: [..., K] float16/bfloat16 (float32 for tests).
        q: int8 [N, K], K contiguous.
        scales: float32 [N] (applied to the fp32 accumulator).
        config: optional tile configuration; default by M.

    Returns:
        [..., N] in x's dtype.

    Raises:
        ValueError: shapes or dtypes that disagree. RuntimeError: triton missing.
    """
    return _channel_w16(FMT_INT8, "int8", "w8a16_gemm", torch.int8, x, q, scales, config)


def _channel_w16(fmt: int, table: str, name: str, code_dtype: torch.dtype, x: torch.Tensor, q: torch.Tensor,
                 scales: torch.Tensor, config: GemmConfig | None) -> torch.Tensor:
    """The weight-only per-channel 8-bit GEMMs (INT8, FP8 E4M3): checks, then the shared launcher."""
    n, k = q.shape
    _check_float_act(x, name)
    if q.dtype != code_dtype or scales.numel() != n:
        raise ValueError(f"{name}: want {str(code_dtype).removeprefix('torch.')} q [N, K] and scales [N], got "
                         f"{q.dtype} {tuple(q.shape)} / {tuple(scales.shape)}")
    x2 = _as_rows(x, k, name)
    out = _launch_gemm(fmt, table, x2, q.contiguous(), scales.float().reshape(-1).contiguous(), None, None,
                       n, 1, x.dtype, config)
    return out.view(*x.shape[:-1], n)


def fp8_w8a16_gemm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                   config: GemmConfig | None = None) -> torch.Tensor:
    """FP8 weight-only (W8A16): ``x @ W^T`` for a per-channel E4M3 weight (``W = q * scales[:, None]``), the codes
    upcast to x's dtype in registers (exact: every E4M3 value is a bf16/fp16 value), fp32 accumulation, the
    channel scale on the accumulator. No activation quantization: at decode sizes this saves the per-token
    rounding pass and keeps x in 16 bits (torchao's float8 weight-only; the SGLang/torchao H100 figures in
    issue 28). Twin: :func:`ref_fp8_w8a16_gemm`.

    Args:
        x: [..., K] float16/bfloat16 (float32 for tests).
        q: float8_e4m3fn [N, K], K contiguous.
        scales: float32 [N].
        config: optional tile configuration; default :data:`CONFIGS` ``"fp8_w8a16"`` (INT8 W8A16's rows: the same
            bytes per weight).

    Returns:
        [..., N] in x's dtype.

    Raises:
        ValueError: shapes or dtypes that disagree. RuntimeError: triton missing.
    """
    return _channel_w16(FMT_FP8_W8A16, "fp8_w8a16", "fp8_w8a16_gemm", torch.float8_e4m3fn, x, q, scales, config)


def ref_fp8_w8a16_gemm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`fp8_w8a16_gemm`: fp32 ``x @ (q * scales)^T`` (the E4M3 values exactly, the scale on the
    fp32 sum), cast to x's dtype."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    out = (x2 @ q.float().t()) * scales.float().reshape(1, -1)
    return out.to(x.dtype).view(*x.shape[:-1], q.shape[0])


def int8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
              out_dtype: torch.dtype = torch.bfloat16, config: GemmConfig | None = None) -> torch.Tensor:
    """W8A8: INT8 x INT8 tensor-core GEMM with int32 accumulation and a scaled epilogue
    ``out[m, n] = float(sum_k xq[m, k] * wq[n, k]) * x_scale[m] * w_scale[n]`` (SmoothQuant, Xiao et al. 2023).

    Args:
        xq: int8 [M, K] (from :func:`per_token_quant_int8`).
        x_scale: float32 [M, 1] or [M].
        wq: int8 [N, K] (:class:`Int8Packed` ``q``).
        w_scale: float32 [N].
        out_dtype: float16, bfloat16 or float32.

    Returns:
        [M, N] in ``out_dtype``. With split-K (small M) each split's exact int32 sum is scaled in fp32
        and the splits are added in fp32.

    Raises:
        ValueError: shapes or dtypes that disagree. RuntimeError: triton missing.
    """
    n, k = wq.shape
    if xq.dtype != torch.int8 or wq.dtype != torch.int8:
        raise ValueError(f"int8_gemm: want int8 xq and wq, got {xq.dtype} / {wq.dtype}")
    if xq.dim() != 2 or xq.shape[1] != k or x_scale.numel() != xq.shape[0] or w_scale.numel() != n:
        raise ValueError(f"int8_gemm: xq {tuple(xq.shape)}, x_scale {tuple(x_scale.shape)}, wq {tuple(wq.shape)}, "
                         f"w_scale {tuple(w_scale.shape)} disagree")
    xs = x_scale.float().reshape(-1).contiguous()
    ws = w_scale.float().reshape(-1).contiguous()
    return _launch_gemm(FMT_INT8_INT8, "int8_int8", _as_rows(xq, k, "int8_gemm"), wq.contiguous(), ws, None, xs,
                        n, 1, out_dtype, config)


def w8a8_gemv(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, config: GemmConfig | None = None
              ) -> torch.Tensor:
    """W8A8 at decode sizes in one launch: ``x`` is quantized per token inside the kernel (INT8 for an int8
    ``wq``, E4M3 for a float8_e4m3fn one; the arithmetic of :func:`per_token_quant_int8` /
    :func:`per_token_quant_fp8`), multiplied exactly (INT8: int32; FP8: fp32 FMAs of E4M3 values), and
    scaled by ``x_scale[m] * w_scale[n]``. Equals quantize-then-GEMM (``int8_gemm``, ``torch._scaled_mm``)
    up to the fp32 summation order. Twin: :func:`ref_w8a8_gemv`.

    Args:
        x: [..., K] float16/bfloat16 (float32 for tests), M = prod of leading dims <= 4 for the default
            config (any M works with a GEMV ``config``, but the tensor-core paths are faster above 4).
        wq: int8 or float8_e4m3fn [N, K], K contiguous.
        w_scale: float32 [N].

    Returns:
        [..., N] in x's dtype.

    Raises:
        ValueError: shapes or dtypes that disagree, or a non-GEMV config. RuntimeError: triton missing.
    """
    n, k = wq.shape
    _check_float_act(x, "w8a8_gemv")
    fmt = {torch.int8: FMT_INT8_INT8, torch.float8_e4m3fn: FMT_FP8}.get(wq.dtype)
    if fmt is None or w_scale.numel() != n:
        raise ValueError(f"w8a8_gemv: want int8 or float8_e4m3fn wq [N, K] and w_scale [N], got {wq.dtype} "
                         f"{tuple(wq.shape)} / {tuple(w_scale.shape)}")
    x2 = _as_rows(x, k, "w8a8_gemv")
    cfg = config or pick_config("int8_int8", max(1, min(x2.shape[0], 4)))
    if not cfg.gemv:
        raise ValueError(f"w8a8_gemv needs a GEMV config (gemv=True), got {cfg}")
    out = _launch_gemm(fmt, "int8_int8", x2, wq.contiguous(), w_scale.float().reshape(-1).contiguous(), None, None,
                       n, 1, x.dtype, cfg, quant_x=True)
    return out.view(*x.shape[:-1], n)


def ref_w8a8_gemv(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`w8a8_gemv`: the per-token quantizer's twin, then the exact product (float64, exact for
    INT8 while K * 127^2 < 2^53, and for products of E4M3 values), scaled in fp32, cast to x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    if wq.dtype == torch.int8:
        xq, xs = ref_per_token_quant_int8(x2)
    else:
        xq, xs = ref_per_token_quant_fp8(x2)
    acc = (xq.double() @ wq.double().t()).float()
    out = acc * xs.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
    return out.to(x.dtype).view(*x.shape[:-1], wq.shape[0])


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """``x @ weight^T`` for a dense weight at small M (decode), split-K when N gives too few programs.

    cuBLAS at M = 1 streams the small Llama-3-8B projections at 0.41-0.54 of read bandwidth on the H200
    (docs/kernels.md); splitting K gives them several programs per SM. Any M works (the tiled rows of
    :data:`CONFIGS` take over above 16), but for M > 16 ``F.linear`` is the one to use.

    Args:
        x: [..., K] float16/bfloat16 (float32 for tests).
        weight: [N, K] in x's dtype, K contiguous.

    Returns:
        [..., N] in x's dtype; fp32 accumulation.

    Raises:
        ValueError: shapes or dtypes that disagree. RuntimeError: triton missing.
    """
    n, k = weight.shape
    _check_float_act(x, "dense_gemv")
    if weight.dtype != x.dtype:
        raise ValueError(f"dense_gemv: weight {weight.dtype} and x {x.dtype} differ")
    x2 = _as_rows(x, k, "dense_gemv")
    out = _launch_gemm(FMT_DENSE, "dense", x2, weight.contiguous(), weight, None, None, n, 1, x.dtype, config)
    return out.view(*x.shape[:-1], n)
