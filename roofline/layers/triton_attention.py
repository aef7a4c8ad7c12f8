"""Triton paged-attention backend for CUDA: Flash-Decoding for decode steps, FlashAttention-style varlen
prefill/extend for everything else. Same contract as ``TorchAttentionBackend`` (layers/attention.py).

Triton is imported here and in roofline/kernels only, so the core never needs it.

CUDA graphs: a decode step (``meta.max_query_len == 1``) reads no per-step host value. seq_lens and
block_tables are device tensors; ``num_splits`` is fixed by static sizes: the batch size, the number of kv
heads, the block table's width times block_size (the longest context a captured graph can serve: the
runner pads block tables to a fixed width per graph) and the SM count. Each split's length is computed
in-kernel from the true seq_len, so one graph serves every context up to that width.
"""

from __future__ import annotations

import torch

from roofline.kernels.decode_attention import choose_num_splits, paged_decode_attention
from roofline.kernels.prefill_attention import paged_prefill_attention
from roofline.kernels.rope_cache import store_kv_cache
from roofline.layers.attention import AttentionBackend, AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    """Writes k/v with a Triton scatter, then runs the decode or the prefill kernel.

    ``decode_num_splits`` (None = automatic, see module docstring) may be set to pin the split count.
    """

    name = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        self.decode_num_splits: int | None = None
        self._num_sms: int | None = None

    def num_splits_for(self, meta: AttentionMetadata, k_cache: torch.Tensor) -> int:
        """Split count of a decode step from static sizes only (CUDA-graph safe)."""
        if self.decode_num_splits is not None:
            return self.decode_num_splits
        if self._num_sms is None:
            self._num_sms = (torch.cuda.get_device_properties(k_cache.device).multi_processor_count
                             if k_cache.is_cuda else 4)
        max_context = meta.block_tables.shape[1] * k_cache.shape[1]
        return choose_num_splits(meta.block_tables.shape[0], self.num_kv_heads, max_context, num_sms=self._num_sms)

    def attend(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], this step's k/v already in
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attention only (for callers that already wrote k/v, e.g. with rope_and_cache)."""
        if meta.max_query_len == 1:
            # Decode: one query per sequence, q rows are sequences in order.
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale,
                                          num_splits=self.num_splits_for(meta, k_cache))
        return paged_prefill_attention(q, k_cache, v_cache, meta, self.scale)

    def forward(self, q, k, v, k_cache, v_cache, meta):
        store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta)
