"""The paged KV cache: one ``KVCache`` per layer, allocated together by a ``KVCachePool``.

Layout (per layer, shared by every backend and kernel):
    k, v: [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale, v_scale: float32 scale tensors of a quantized cache (None in 16/32-bit caches):
        int8:      [num_blocks, block_size, num_kv_heads], one per slot and KV head, written with the token;
        fp8_e4m3:  [num_kv_heads], the layer's static per-head scales (1.0 until calibrated at start-up).
    The formats, and why float32 scales, are in ``roofline.kernels.common``.
A token's *slot* is ``block_id * block_size + offset_in_block``. The engine's block manager hands out
block ids; the pool only owns the memory.

Bytes per token come from ``roofline.costmodel.kv_cache_bytes_per_token``, the same function the bound
model uses, so the pool size and the floor can never disagree (int8's per-token scales are counted; fp8's
per-head scales are a constant 2 x layers x H_kv x 4 bytes, not per token).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from roofline import costmodel

# The dtypes the cache stores; the bound model reads their torch names (roofline.costmodel.canonical_dtype).
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn)
QUANTIZED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)


@dataclass
class KVCache:
    """One layer's cache. ``k``/``v``: [num_blocks, block_size, num_kv_heads, head_dim]; ``k_scale``/``v_scale``
    as in the module docstring."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def is_quantized(self) -> bool:
        return self.k.dtype in QUANTIZED_KV_DTYPES


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V bytes one token occupies across all layers (scales included, when a format has them).

    Raises:
        ValueError: a dtype the cache does not support (lists the supported ones).
    """
    if dtype not in KV_DTYPES:
        raise ValueError(f"unsupported KV-cache dtype {dtype}; supported: {', '.join(map(str, KV_DTYPES))}")
    return int(costmodel.kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, str(dtype)))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor for the cache. On the CPU it lives in an anonymous memory mapping, whose pages the kernel
    zeroes when first touched: a pool of gigabytes costs nothing until its blocks are written (``torch.zeros``
    writes every page up front, ~0.5-3 s per GiB on a laptop, and holds it resident)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1))  # the tensor keeps the mapping alive
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


class KVCachePool:
    """``num_layers`` caches of ``num_blocks`` blocks each, on ``device``.

    Args:
        num_kv_heads: KV heads on this rank (after tensor-parallel sharding).
        dtype: element dtype of k and v: float32/float16/bfloat16, or int8 / float8_e4m3fn (quantized,
            with float32 scales; see the module docstring).

    Raises:
        ValueError: num_blocks < 1 or an unsupported dtype.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.bytes_per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)

        def scales() -> torch.Tensor | None:
            if dtype == torch.int8:  # per slot and head; 0 until a token is stored (dequantizes to 0)
                return _zeros(shape[:3], torch.float32, device)
            if dtype == torch.float8_e4m3fn:  # per head, static: 1.0 until calibrated
                return torch.ones(num_kv_heads, dtype=torch.float32, device=device)
            return None

        # One allocation [num_layers, 2 (k, v), *shape]: each layer's k and v are contiguous views of it, and an
        # operation on every layer's slots (speculative trees' KV compaction) is one indexing op over all of it.
        self.kv = _zeros((num_layers, 2, *shape), dtype, device)
        self.caches = [KVCache(self.kv[i, 0], self.kv[i, 1], scales(), scales()) for i in range(num_layers)]

    @property
    def num_tokens(self) -> int:
        """Token capacity: every block full."""
        return self.num_blocks * self.block_size

    @property
    def is_quantized(self) -> bool:
        return self.dtype in QUANTIZED_KV_DTYPES

    def __getitem__(self, layer_id: int) -> KVCache:
        return self.caches[layer_id]

    def __len__(self) -> int:
        return len(self.caches)

    @staticmethod
    def num_blocks_for(budget_bytes: int, bytes_per_token: int, block_size: int) -> int:
        """How many blocks fit in ``budget_bytes``."""
        return int(budget_bytes // (bytes_per_token * block_size))
