"""The INT4 (W4A16) tensor-core GEMM for decode-sized M (1-64) on sm_80+: the repack into the *mma layout* and
the launcher of the Gluon kernel in :mod:`roofline.kernels.gluon_w4a16` (its docstring has the design and the
layout). The GPTQ-style ``qweight`` ``[K / 8, N]`` stays the checkpoint and prefill layout; this one is made
from it once at load (``linear_dispatch.prepare_w4a16``), as vLLM's Marlin path repacks in
``process_weights_after_loading``.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch

from roofline.kernels import pdl
from roofline.kernels.quant_layouts import _as_rows

log = logging.getLogger(__name__)

# Process-wide, read when a layer's weights are prepared (load time, so before graph capture): False keeps
# the Triton INT4 kernels (``roofline bench decode --int4-kernel mma,triton`` measures both in one process).
ENABLED = True
MMA_K_TILE = 128  # input channels per word tile; also the only group size the kernel takes
MMA_MAX_M = 64  # rows of x one launch takes (BLOCK_M <= 64)


class MmaConfig(NamedTuple):
    """A launch configuration: rows of x per program (a multiple of 8), output channels per program (a multiple
    of 16 * num_warps), k-tiles of weights in flight per thread (1 or 2 prefetched in registers; 3 or more: a
    cp.async ring of that many tiles in shared memory, 8 KB each at BN 128), x prefetched a tile ahead, K splits
    (None: by the grid, ``quant_gemm.choose_split_k``), and ``persistent``: 0 for one program per work item
    (column tile, K split), else that many programs per SM, each streaming its items' k-tiles as one chain with
    the next tile always in flight (stages 1 with x prefetched only; the split is then rounded down to a
    power of two that divides K / 128), and ``wgmma``: the Hopper kernel (``gluon_w4a16_wgmma``: register-A
    ``wgmma`` with x staged in shared memory; sm_90 only, num_warps 4 or 8, block_n a multiple of 16 * num_warps
    and of 64, no persistent grid; stages and prefetch_x do not apply): 0 off, 1 one k-tile at a time, 2 two
    k-tiles a loop body, the second dequantized while the first's products run."""

    block_m: int
    block_n: int
    num_warps: int
    stages: int = 1
    prefetch_x: bool = True
    split_k: int | None = None
    persistent: int = 0
    wgmma: int = 0


# Defaults by the largest M each serves, where no measured table row exists: the fastest tiles of the first
# H200 sweep (bench/results/int4-mma-20261204/w4a16_mma-call1.json), compiled without spills for sm_90.
DEFAULT_TILES = ((8, MmaConfig(8, 128, 8)), (16, MmaConfig(16, 128, 4)), (32, MmaConfig(32, 128, 4, prefetch_x=False)),
                 (64, MmaConfig(64, 64, 4, prefetch_x=False)))
# On sm_90 (Hopper) above M = 16 the wgmma kernel, two k-tiles a loop body, wins over mma.sync at every Llama-3-8B
# projection and M = 32 / 64 measured (H100, chained launches: gate_up M = 64 62-64 us against 104, M = 32 42.5
# against 65; bench/results/int4-persist-20261206/call4-wgmma, call8-wgmma-two-tile-body); these are its tiles
# there (the most frequent winners), for Hopper parts with no measured table.
HOPPER_TILES = ((32, MmaConfig(32, 128, 4, split_k=4, wgmma=2)), (64, MmaConfig(64, 128, 8, split_k=4, wgmma=2)))
# Bit of nibble j of a word in the mma layout: pairs (j, j + 1) share one LOP3 (low and high bf16 halves).
_NIBBLE_SHIFT = (0, 16, 4, 20, 8, 24, 12, 28)


def repack_int4_mma(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ-style words int32 ``[K / 8, N]`` (nibble i of word ``[r, n]`` = code of input channel ``8 r + i``)
    -> the mma layout int32 ``[K / 128, N * 16]`` (``gluon_w4a16`` docstring).

    Raises:
        ValueError: ``qweight`` not a 2-D int32 tensor, or K not a multiple of 128 (the tensor and its shape
            are named).
    """
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[0] % (MMA_K_TILE // 8):
        raise ValueError(f"repack_int4_mma: qweight must be int32 [K / 8, N] with K a multiple of {MMA_K_TILE}, "
                         f"got {qweight.dtype} {tuple(qweight.shape)}")
    k8, n = qweight.shape
    q = qweight.to(torch.int64) & 0xFFFFFFFF
    codes = torch.stack([(q >> (4 * i)) & 0xF for i in range(8)], dim=-1)  # [K/8, N, 8]: channel 8 r + i
    shifts = torch.tensor(_NIBBLE_SHIFT, dtype=torch.int64, device=q.device)
    words = (codes << shifts).sum(dim=-1)  # [K/8, N], nibble order of the mma layout
    # word row r = 16 kt + 4 rb + t (channel 128 kt + 32 rb + 8 t + j) -> [kt, n, t, rb]
    words = words.view(k8 // 16, 4, 4, n).permute(0, 3, 2, 1)  # [kt, n, t, rb]
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.reshape(k8 // 16, n * 16).to(torch.int32).contiguous()


def unpack_int4_mma(words: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`repack_int4_mma`: int32 ``[K / 128, N * 16]`` -> GPTQ-style int32 ``[K / 8, N]``."""
    kt = words.shape[0]
    w = (words.to(torch.int64) & 0xFFFFFFFF).view(kt, n, 4, 4).permute(0, 3, 2, 1).reshape(kt * 16, n)
    codes = [(w >> s) & 0xF for s in _NIBBLE_SHIFT]
    out = sum(c << (4 * i) for i, c in enumerate(codes))
    out = torch.where(out >= 2**31, out - 2**32, out)
    return out.to(torch.int32).contiguous()


@functools.cache
def gluon_available(device_index: int) -> bool:
    """Whether this CUDA device (sm_80+) and this Triton (with Gluon) run the mma kernel."""
    try:
        from roofline.kernels import gluon_w4a16
    except Exception:  # noqa: BLE001 - any import failure means no Gluon
        return False
    major, _ = torch.cuda.get_device_capability(device_index)
    return gluon_w4a16.gluon is not None and major >= 8


def mma_supported(n: int, k: int, group_size: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """None if the mma kernel takes an ``[N, K]`` INT4 weight with this group size in ``dtype`` on ``device``,
    else the reason it does not (for one start-up log line)."""
    if not ENABLED:
        return "turned off (roofline.kernels.w4a16_mma.ENABLED)"
    if device.type != "cuda":
        return f"device {device.type}"
    if not gluon_available(device.index if device.index is not None else torch.cuda.current_device()):
        return "no Gluon or a GPU before sm_80"
    if dtype != torch.bfloat16:
        return f"activation dtype {dtype} (the kernel is bf16)"
    if group_size != MMA_K_TILE:
        return f"group size {group_size} (the kernel takes {MMA_K_TILE})"
    if k % MMA_K_TILE or n % 128:
        return f"shape [N={n}, K={k}] (needs K % {MMA_K_TILE} == 0 and N % 128 == 0)"
    return None


def pick_tile(m: int, hopper: bool = False) -> MmaConfig:
    """The default :class:`MmaConfig` for ``m`` rows (:data:`DEFAULT_TILES`; with ``hopper``, an sm_90 device,
    :data:`HOPPER_TILES` above M = 16).

    Raises:
        ValueError: ``m`` above :data:`MMA_MAX_M`.
    """
    for max_m, cfg in (HOPPER_TILES if hopper and m > 16 else DEFAULT_TILES):
        if m <= max_m:
            return cfg
    raise ValueError(f"w4a16_mma_gemm takes M <= {MMA_MAX_M} rows, got {m}")


def w4a16_mma_gemm(x: torch.Tensor, qweight_mma: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   config: MmaConfig | None = None, pdl_mode: int | None = None) -> torch.Tensor:
    """``x @ W^T`` for an INT4 weight in the mma layout, on tensor cores; fp32 accumulation.

    Args:
        x: [..., K] bfloat16, CUDA, at most :data:`MMA_MAX_M` rows.
        qweight_mma: int32 [K / 128, N * 16] (:func:`repack_int4_mma`).
        scales, zeros: bfloat16 [K / 128, N] (group size 128; zeros are the integer zero points 0..15).
        config: the launch configuration, default :func:`pick_tile` (its Hopper tiles on sm_90).
        pdl_mode: programmatic dependent launch mode (``roofline.kernels.pdl``), default the process-wide one.

    Returns:
        [..., N] bfloat16; equal to ``quant_gemm.ref_w4a16_gemm`` up to the fp32 summation order.

    Raises:
        ValueError: shapes or dtypes that disagree, or more than 64 rows.
    """
    from roofline.kernels.quant_gemm import _num_sms, choose_split_k
    from roofline.kernels.splitk import arrival_counters as _counters

    kt, n16 = qweight_mma.shape
    n, k = n16 // 16, kt * MMA_K_TILE
    if (x.dtype != torch.bfloat16 or qweight_mma.dtype != torch.int32 or scales.shape != (kt, n)
            or zeros.shape != (kt, n) or scales.dtype != torch.bfloat16 or zeros.dtype != torch.bfloat16):
        raise ValueError(f"w4a16_mma_gemm: x {x.dtype}, qweight_mma {qweight_mma.dtype} {tuple(qweight_mma.shape)}, "
                         f"scales {scales.dtype} {tuple(scales.shape)}, zeros {zeros.dtype} {tuple(zeros.shape)} "
                         f"disagree (want bf16 x, int32 [K/128, N*16], bf16 [K/128, N] with group 128)")
    x2 = _as_rows(x, k, "w4a16_mma_gemm")
    m = x2.shape[0]
    cfg = config or pick_tile(m, x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9)
    bm, bn, nw = cfg.block_m, cfg.block_n, cfg.num_warps
    if m > bm or n % bn:
        raise ValueError(f"w4a16_mma_gemm: M={m} rows and N={n} do not fit the tile BLOCK_M={bm}, BN={bn}")
    if cfg.wgmma and (cfg.persistent or nw not in (4, 8) or bn % 64 or int(cfg.wgmma) not in (1, 2)
                      or x.device.type == "cuda"
                      and torch.cuda.get_device_capability(x.device)[0] != 9):
        raise ValueError(f"w4a16_mma_gemm: wgmma in (1, 2) takes an sm_90 GPU, num_warps 4 or 8, block_n a multiple "
                         f"of 64 and no persistent grid, got wgmma={cfg.wgmma}, num_warps={nw}, block_n={bn}, "
                         f"persistent={cfg.persistent} on {x.device}")
    if cfg.persistent and (cfg.stages != 1 or not cfg.prefetch_x):
        raise ValueError(f"w4a16_mma_gemm: persistent={cfg.persistent} takes stages=1 and prefetch_x=True, got "
                         f"stages={cfg.stages}, prefetch_x={cfg.prefetch_x}")
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    tiles = n // bn
    split = cfg.split_k or choose_split_k(tiles, kt, _num_sms(x.device))
    split = max(1, min(split, kt))
    if cfg.persistent:
        while kt % split:  # the persistent stream takes equal splits
            split //= 2
    per_split = -(-kt // split)
    split = -(-kt // per_split)
    partials = torch.empty((split, m, n) if split > 1 else (1,), dtype=torch.float32, device=x.device)
    counters = _counters(x.device, tiles)
    launch = pdl.launch_kwargs(x.device, pdl_mode)
    args = (x2, qweight_mma, scales, zeros, out, partials, counters, m, n, k, per_split, split,
            x2.stride(0), scales.stride(0), out.stride(0))
    if cfg.wgmma:
        from roofline.kernels.gluon_w4a16_wgmma import _w4a16_wgmma_kernel

        _w4a16_wgmma_kernel[(tiles, split)](*args, BLOCK_M=bm, BN=bn, NUM_WARPS=nw, PIPE=int(cfg.wgmma), num_warps=nw,
                                            **launch)
    else:
        from roofline.kernels.gluon_w4a16 import _w4a16_mma_kernel

        grid = (min(tiles * split, cfg.persistent * _num_sms(x.device)),) if cfg.persistent else (tiles, split)
        _w4a16_mma_kernel[grid](*args, BLOCK_M=bm, BN=bn, NUM_WARPS=nw, STAGES=cfg.stages,
                                XPRE=bool(cfg.prefetch_x), PERSIST=int(bool(cfg.persistent)), num_warps=nw, **launch)
    return out.view(*x.shape[:-1], n)
