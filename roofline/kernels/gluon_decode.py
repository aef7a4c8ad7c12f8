"""The Gluon stage 1 of split-KV decode for an int8 / fp8 (e4m3) KV cache: support check, kernel choice and
launcher (the kernel and its design: :mod:`roofline.kernels.gluon_decode_kernels`; issue 29).

``paged_decode_attention`` runs it when the caller names no variant (the Triton backend's default), the
query_len is 1, the cache is int8 or fp8 and :func:`gluon_decode_unsupported_reason` returns None; otherwise the
Triton kernels, with one log line per reason. ``ROOFLINE_DECODE_KERNEL`` (read per call): "auto" (default: gluon
on sm_90, where it was compiled and measured), "gluon" (also other sm_80+ GPUs) or "triton" (never gluon).
``variant="gluon"`` asks for it explicitly (``roofline bench attention --decode-only --variants old,mma,gluon``).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

try:
    from roofline.kernels.gluon_decode_kernels import (
        GLUON_HEAD_DIMS,
        GLUON_MAX_GROUP,
        _gluon_decode_kernel,
        gluon,
    )
except ImportError:  # pragma: no cover - a Triton without Gluon
    gluon = None
    GLUON_HEAD_DIMS, GLUON_MAX_GROUP = (64, 128), 8

logger = logging.getLogger(__name__)

DECODE_KERNEL_ENV = "ROOFLINE_DECODE_KERNEL"
DECODE_KERNELS = ("auto", "triton", "gluon")
# The default tile: 32 keys per program of one warp (two 16-key MMA row blocks), the next tile prefetched in
# registers, and 4x the splits of a 4-warp program. H200, D 128, GQA 4, block 64 (bench/results/kvq-20261204/
# tiles.log): int8 / fp8 KV at 64 x 32k 1203 / 1074 us (0.87 / 0.95 of read bandwidth; bf16 KV 2014 us), at 8 x 32k
# 168 / 154 us (bf16 255 us); the first default, 64 keys x 4 warps, 1603 / 1530 and 271 / 263 us.
GLUON_BLOCK_N = 32
GLUON_NUM_WARPS = 1
_logged: set[str] = set()


def decode_kernel_choice(requested: str | None = None) -> str:
    """``requested``, else ``ROOFLINE_DECODE_KERNEL``, else "auto".

    Raises:
        ValueError: a value outside :data:`DECODE_KERNELS` (named with the allowed ones).
    """
    choice = (requested or os.environ.get(DECODE_KERNEL_ENV) or "auto").strip().lower()
    if choice not in DECODE_KERNELS:
        raise ValueError(f"{DECODE_KERNEL_ENV}={choice!r}; allowed: {', '.join(DECODE_KERNELS)}")
    return choice


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def gluon_decode_unsupported_reason(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, quant: int,
                                    query_len: int, choice: str = "auto") -> str | None:
    """Why the Gluon decode kernel cannot run this call (a short phrase naming the value), or None if it can.

    ``quant``: ``roofline.kernels.common``'s KV_QUANT_* mode (0 none, 1 int8 per token, 2 fp8 per head).
    """
    if gluon is None:
        return "triton.experimental.gluon is not importable"
    if choice == "triton":
        return f"{DECODE_KERNEL_ENV}=triton"
    if not q.is_cuda:
        return f"device {q.device} is not CUDA"
    major, minor = _capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if choice == "auto" and major != 9:
        return f"compute capability {major}.{minor} is not 9.x (set {DECODE_KERNEL_ENV}=gluon for sm_80+)"
    if major < 8:
        return f"compute capability {major}.{minor} is below 8.0 (mma_v2)"
    if quant == 0:
        return f"KV cache dtype {k_cache.dtype} is not int8 / float8_e4m3fn"
    if query_len != 1:
        return f"query_len {query_len} (the kernel takes 1)"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"q dtype {q.dtype} (needs bf16 or fp16: the products run in fp16)"
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if head_dim not in GLUON_HEAD_DIMS:
        return f"head_dim {head_dim} not in {GLUON_HEAD_DIMS}"
    if num_heads // num_kv_heads > GLUON_MAX_GROUP:
        return f"GQA group {num_heads // num_kv_heads} above {GLUON_MAX_GROUP} query heads per kv head"
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1) or not 8 <= block_size:
        return f"block_size {block_size} is not a power of two >= 8"
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        return f"strides q {q.stride()} / cache {k_cache.stride()}: head_dim must be contiguous"
    if k_cache.stride(1) % 16 or v_cache.stride(1) % 16 or k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16:
        return f"cache slot stride {k_cache.stride(1)} or base not 16-byte aligned"
    return None


def gluon_config_reason(block_n: int, num_warps: int, head_dim: int) -> str | None:
    """Why (block_n, num_warps) is not a tile of the Gluon kernel at ``head_dim``, or None: warps split the keys
    of S^T and the head_dim rows of O^T in 16-row MMA tiles, so both must be multiples of 16 x num_warps."""
    if num_warps not in (1, 2, 4, 8) or block_n % (16 * num_warps) or head_dim % (16 * num_warps) or block_n > 256:
        return (f"block_n {block_n} x num_warps {num_warps} at head_dim {head_dim}: needs num_warps in 1/2/4/8, "
                f"block_n <= 256 and block_n, head_dim multiples of 16 x num_warps")
    return None


def log_fallback_once(reason: str) -> None:
    """One INFO line per distinct reason the Triton decode kernel ran instead of the Gluon one."""
    if reason not in _logged:
        _logged.add(reason)
        logger.info("gluon decode: %s; using the Triton decode kernel", reason)


def launch_gluon_split(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, mid_o, mid_lse,
                       scale_log2e: float, quant: int, per_token_stride: int, num_splits: int,
                       split_align: int, block_n: int = GLUON_BLOCK_N, num_warps: int = GLUON_NUM_WARPS,
                       prefetch: bool = True) -> None:
    """Stage 1 on the Gluon kernel: fills mid_o [num_seqs, H, S, D] / mid_lse [num_seqs, H, S] (fp32, lse base 2).

    Called by ``paged_decode_attention`` after its checks and :func:`gluon_decode_unsupported_reason`; the
    arguments are its own (query_len 1; block_n and num_warps checked by :func:`gluon_config_reason`;
    ``prefetch``: the next tile loaded while this one is computed, ``num_stages >= 2`` there).
    """
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    _gluon_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, mid_o, mid_lse,
        scale_log2e,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(2),
        block_tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        STRIDE_KS=k_cache.stride(1), STRIDE_VS=v_cache.stride(1), S_SLOT=per_token_stride,
        GROUP=num_heads // num_kv_heads, PAGE=block_size, HEAD_DIM=head_dim, BLOCK_N=block_n,
        SPLIT_ALIGN=split_align, NUM_SPLITS=num_splits, QUANT=quant, NUM_WARPS=num_warps,
        PREFETCH=bool(prefetch), num_warps=num_warps,
    )
