"""The attention backend interface: it owns the KV cache, stores each step's k/v, and attends.

One step's batch is flat (no padding): the ``num_tokens`` new tokens of all sequences laid end to end,
sequence ``i`` owning rows ``query_start_loc[i]:query_start_loc[i+1]``. Each new token attends causally to
its sequence's cached prefix plus the new tokens up to itself. That one rule covers prefill, chunked
prefill (a chunk attends to the chunks before it), decode (one query token), prefix-cache hits and
speculative verification.

Per step the worker builds the common ``AttentionMetadata`` once and hands it to ``build_metadata``,
where a backend precomputes whatever it needs (gather indices, masks, split counts), so no layer does
Python work. Per layer, ``forward(q, k, v, positions, cache, meta)`` applies RoPE, stores k/v at
``slot_mapping`` and attends.

CUDA graphs: a backend that can be captured sets ``supports_cuda_graphs`` and implements
``init_capture`` (static metadata buffers), ``capture_metadata`` (the metadata a captured graph reads)
and ``prepare_replay`` (copy a step's metadata into those buffers). The worker runs eager, with a log
line, for a backend that cannot be captured.
"""

from __future__ import annotations

import importlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from roofline.attention.kv_cache import KVCache, KVCachePool
from roofline.layers.rotary import RotaryEmbedding


@dataclass
class AttentionMetadata:
    """Device tensors and host lists describing one step's flat batch.

    Attributes:
        slot_mapping: [num_tokens] int64, cache slot of each new token (negative: padding, not stored).
        query_start_loc: [num_seqs + 1] int32, cumulative new-token counts (cu_seqlens_q).
        seq_lens: [num_seqs] int32, context length of each sequence *after* this step (cached prefix + new
            tokens), i.e. the keys each sequence's last query sees.
        block_tables: [num_seqs, max_num_blocks_per_seq] int32, padded with 0 (never read past seq_lens).
        max_query_len: host int, max new tokens of one sequence in this step.
        query_lens_cpu, seq_lens_cpu: host lists of the per-sequence new-token counts and context lengths.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Owns the paged KV cache of every layer; stores each step's k/v and computes attention.

    Implementations must be exact (up to floating-point reassociation) against the pure-torch reference
    ``roofline.kernels.prefill_attention.ref_paged_attention``.

    Args:
        num_heads, num_kv_heads: heads on this rank.
        head_dim: per-head size.
        rotary: the model's RoPE table, applied to q and k before the store.
        scale: softmax scale, default 1/sqrt(head_dim) (Vaswani et al. 2017).
    """

    name: str = "abstract"
    supports_cuda_graphs: bool = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, rotary: RotaryEmbedding,
                 scale: float | None = None):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rotary = rotary
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        self.kv_pool: KVCachePool | None = None

    # ------------------------------------------------------------------------------ the KV cache

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                          device: torch.device) -> KVCachePool:
        """Allocate (and own) the caches of every layer."""
        self.kv_pool = KVCachePool(num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim, dtype,
                                   device)
        return self.kv_pool

    def kv_cache(self, layer_id: int) -> KVCache:
        if self.kv_pool is None:
            raise RuntimeError("the KV cache is not allocated yet (allocate_kv_cache)")
        return self.kv_pool[layer_id]

    # ------------------------------------------------------------------------------ per step

    def build_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Precompute, once per step, what every layer's ``forward`` needs. Default: nothing."""
        return meta

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], before RoPE
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], before RoPE
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        positions: torch.Tensor,  # [num_tokens] int64
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Rotate q/k, store k/v at ``meta.slot_mapping`` in ``cache``, then attend. May modify q and k."""

    # ------------------------------------------------------------------------------ CUDA graphs

    def init_capture(self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device) -> None:
        raise NotImplementedError(f"the {self.name} attention backend cannot be captured in CUDA graphs")

    def capture_metadata(self, batch_size: int) -> AttentionMetadata:
        """Decode metadata over the static buffers, for capturing a graph of ``batch_size`` rows."""
        raise NotImplementedError(f"the {self.name} attention backend cannot be captured in CUDA graphs")

    def prepare_replay(self, batch_size: int, meta: AttentionMetadata) -> None:
        """Copy a decode step's ``meta`` (its first ``meta.num_seqs`` rows) into the static buffers and pad
        the rest of the ``batch_size`` rows (slot -1, context 0)."""
        raise NotImplementedError(f"the {self.name} attention backend cannot be captured in CUDA graphs")


_BACKENDS: dict[str, str] = {
    "torch": "roofline.attention.torch_backend:TorchAttentionBackend",
    "triton": "roofline.attention.triton_backend:TritonAttentionBackend",
}


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """Look up a backend class by name; GPU backends import lazily.

    Raises:
        ValueError: unknown name (lists the registered ones).
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; registered: {', '.join(sorted(_BACKENDS))}")
    module_name, cls_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)
