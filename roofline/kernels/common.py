"""Input checks shared by the paged attention kernels."""

from __future__ import annotations

from typing import Protocol

import torch


class PagedBatch(Protocol):
    """What the paged attention kernels read of a step's attention metadata (device tensors + one host int)."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    max_query_len: int


def check_paged_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """q [T, H, D]; caches [num_blocks, block_size, H_kv, D], equal shapes, contiguous last dims, H % H_kv == 0.

    Raises:
        ValueError: naming the shapes that disagree.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, d_cache = k_cache.shape[2], k_cache.shape[3]
    if d_cache != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} and caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} disagree")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous last dim")
