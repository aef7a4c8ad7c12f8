"""Launcher of the warp-specialized weight-only Gluon GEMM (``roofline.kernels.gluon_ws_gemm``) for Hopper, INT8
(W8A16) and INT4 (W4A16): TMA descriptors, the register cap and the grid. ``quant_gemm.w8a16_gemm`` and
``w4a16_gemm`` run it for a ``GemmConfig`` with ``ws`` set where :func:`ws_unsupported_reason` says it can, and
Triton's tiled kernel (``quant_gemm.CONFIGS``' default for M) otherwise."""

from __future__ import annotations

import functools

import torch

try:
    import triton
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from roofline.kernels.gluon_ws_gemm import gluon_ws_gemm_kernel, ws_maxnreg
except ImportError:  # pragma: no cover - Triton without Gluon's Hopper module
    gluon_ws_gemm_kernel = None

MAX_SMEM = 232448  # bytes of dynamic shared memory a block may use on sm_90 (CUDA C++ guide, H100 / H200: 227 KB)
CVT_WARPS = 4
CVT_REGS = 128


def mma_warps(block_m: int) -> int:
    """Warps of the MMA partition: one warpgroup (4) for a 64-row tile, two (8) for 128 or 256 rows (at 256 each
    warpgroup issues two m64 ``wgmma`` a K step, so a weight tile is converted once for 256 rows)."""
    return 4 if block_m == 64 else 8


@functools.cache
def _sm90(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def ws_unsupported_reason(x: torch.Tensor, q: torch.Tensor, block_m: int, block_n: int, block_k: int,
                          stages: int, group_size: int | None = None) -> str | None:
    """Why the kernel cannot run this call (None: it can): Gluon missing, not an sm_90 GPU, x not bf16/fp16 with
    16-byte aligned rows, K not a multiple of 16, a tile that does not fit (BLOCK_M 64, 128 or 256, BLOCK_K a
    multiple of 64, BLOCK_N a multiple of 64 up to 256 (``wgmma``'s N), shared memory over ``MAX_SMEM``). ``q``
    int8 [N, K] codes, or (``group_size`` given) INT4 qweight int32 [K / 8, N], whose group size must be a multiple
    of BLOCK_K and N a multiple of 4 (16-byte TMA rows)."""
    if gluon_ws_gemm_kernel is None:
        return "triton.experimental.gluon's Hopper module is not importable"
    if not (x.is_cuda and _sm90(x.device.index)):
        return "not an sm_90 GPU"
    int4 = group_size is not None
    if x.dtype not in (torch.bfloat16, torch.float16) or q.dtype != (torch.int32 if int4 else torch.int8):
        return f"x {x.dtype} / codes {q.dtype} (bf16 or fp16 x, {'int32 INT4 words' if int4 else 'int8 codes'})"
    k = x.shape[1]
    if k % 16 or x.stride(1) != 1 or (x.stride(0) * 2) % 16 or x.data_ptr() % 16 or q.data_ptr() % 16:
        return "TMA needs K % 16 == 0 and 16-byte aligned, row-contiguous x and codes"
    if int4 and (group_size % block_k or q.shape[1] % 4):
        return f"INT4 group size {group_size} not a multiple of BLOCK_K {block_k}, or N {q.shape[1]} not of 4"
    code_bytes = block_n * block_k // 2 if int4 else block_n * block_k
    need = stages * (block_m * block_k * 2 + code_bytes + block_n * block_k * 2 + 24)
    if block_m not in (64, 128, 256) or block_k % 64 or block_n % 64 or block_n > 256 or need > MAX_SMEM:
        return f"tile {block_m}x{block_n}x{block_k} x {stages} stages does not fit"
    return None


def choose_ws_split(tiles: int, k_tiles: int, num_sms: int) -> int:
    """K splits for the ws kernel: one resident program per SM (its shared memory takes the SM), so split until the
    grid has about one program per SM, a power of two, each split >= 8 K tiles. 1 where the tiles fill the GPU.
    Llama-3-8B at M = 128, BLOCK 128 x 128 x 64, 132 SMs: o_proj (32 tiles, 64 K tiles) 4, qkv (48) 2, down (32,
    224 K tiles) 4, gate_up (224) 1."""
    split = 1
    while tiles * split * 2 <= num_sms and k_tiles // (split * 2) >= 8:
        split *= 2
    return split


def w8a16_ws_gemm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_m: int, block_n: int,
                  block_k: int, stages: int, split_k: int | None = None, num_sms: int | None = None,
                  counters: torch.Tensor | None = None, loader: bool = True,
                  cvt_warps: int = CVT_WARPS) -> torch.Tensor:
    """``x`` [M, K] bf16/fp16 @ (``q`` int8 [N, K] * ``scales`` float32 [N])^T -> [M, N] in x's dtype (fp32
    accumulation, the scale in the epilogue). ``split_k`` None: :func:`choose_ws_split`; with more than one split
    the fp32 partial sums go to a scratch buffer and the last split of each output tile sums them in split order
    (deterministic) in the same launch. ``num_sms``: the GPU's (``quant_gemm`` passes its count; None: asked of the
    device); ``counters``: a zeroed int32 buffer of at least one counter per output tile, left zeroed
    (``quant_gemm`` passes its own; None: a fresh one). ``loader`` False (``GemmConfig.ws == 2``): no loader warp,
    the converter issues the TMA copies, so the MMA partition gets more registers (168 at BLOCK_M 128, which
    128 x 256 tiles need). ``cvt_warps``: the converter partition's warps (4; 8 compiles, gives the same bits and
    was 2-9% slower on every probed tile on the H100, bench/results/ws-variants-h100-20261207/, so no table row
    asks for it). The caller checked :func:`ws_unsupported_reason`."""
    n = q.shape[0]
    q_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.int8)
    q_desc = TensorDescriptor(q, [n, x.shape[1]], [q.stride(0), 1], [block_n, block_k], q_layout)
    return _launch(x, q_desc, n, scales, scales, block_k, 0, block_m, block_n, block_k, stages, split_k, num_sms,
                   counters, loader, cvt_warps)


def w4a16_ws_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int, block_m: int, block_n: int, block_k: int, stages: int, split_k: int | None = None,
                  num_sms: int | None = None, counters: torch.Tensor | None = None,
                  loader: bool = True, int4_packed: bool = True, cvt_warps: int = CVT_WARPS) -> torch.Tensor:
    """INT4 on the same kernel: ``x`` [M, K] bf16/fp16 @ W^T, W = (q - zeros) * scales per group of
    ``group_size`` input channels, ``qweight`` int32 [K / 8, N] (``quant_layouts.pack_int4``), ``scales`` /
    ``zeros`` [K / G, N] in x's dtype -> [M, N] in x's dtype. The converter partition dequantizes each code tile
    to round((q - z) * s) in x's dtype (``quant_gemm.ref_w4a16_gemm``'s weights) and stores it; fp32
    accumulation. Other arguments as :func:`w8a16_ws_gemm`; the caller checked :func:`ws_unsupported_reason` with
    ``group_size``. ``int4_packed`` (default): the dequantization in packed 16-bit math, two codes an instruction;
    False: in fp32. Both give the same bits (a GPU test compares every weight); on the H100 the packed form took
    0.90-0.97x the fp32 form's time on every probed tile at M = 128 / 256
    (bench/results/ws-validate-20261207/)."""
    n = qweight.shape[1]
    q_layout = gl.NVMMASharedLayout.get_default_for([block_k // 8, block_n], gl.int32)
    q_desc = TensorDescriptor(qweight, [qweight.shape[0], n], [qweight.stride(0), 1], [block_k // 8, block_n],
                              q_layout)
    return _launch(x, q_desc, n, scales, zeros, group_size, 2 if int4_packed else 1, block_m, block_n, block_k,
                   stages, split_k, num_sms, counters, loader, cvt_warps)


def _launch(x, q_desc, n, scales, zeros, group, int4, block_m, block_n, block_k, stages, split_k, num_sms, counters,
            loader, cvt_warps) -> torch.Tensor:
    m, k = x.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    gdt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    x_layout = gl.NVMMASharedLayout.get_default_for([block_m, block_k], gdt)
    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gdt)
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [block_m, block_k], x_layout)
    num_warps = mma_warps(block_m)
    maxnreg = ws_maxnreg(num_warps, cvt_warps, loader)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    per_split = triton.cdiv(k_tiles, min(split_k or choose_ws_split(
        tiles, k_tiles, num_sms or torch.cuda.get_device_properties(x.device).multi_processor_count), k_tiles))
    split = triton.cdiv(k_tiles, per_split)  # no empty trailing split
    partials = torch.empty((split, m, n) if split > 1 else (1,), dtype=torch.float32, device=x.device)
    if counters is None:  # split 1 never touches the counters: no memset then
        counters = (torch.zeros(tiles, dtype=torch.int32, device=x.device) if split > 1
                    else torch.empty(1, dtype=torch.int32, device=x.device))
    gluon_ws_gemm_kernel[(tiles, split)](
        x_desc, q_desc, scales, out, partials, counters, m, n, k, out.stride(0), per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, SPLIT_K=split, CVT_WARPS=cvt_warps,
        CVT_REGS=min(CVT_REGS, maxnreg), W_LAYOUT=w_layout, num_warps=num_warps, LOADER=loader, Z=zeros,
        GROUP=group, INT4=int4, maxnreg=maxnreg)
    return out
