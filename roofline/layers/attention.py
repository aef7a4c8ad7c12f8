"""Paged attention: the backend interface, its registry, and the exact pure-torch backend.

KV cache layout (per layer, shared by every backend and kernel):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A token's *slot* is ``block_id * block_size + offset_in_block``; ``slot_mapping`` says where each new
token's k/v goes, and a sequence's *block table* lists its blocks in order.

One step's batch is flat (no padding): the ``num_tokens`` new tokens of all sequences laid end to end,
sequence ``i`` owning rows ``query_start_loc[i]:query_start_loc[i+1]``. Each new token attends causally
to its sequence's cached prefix plus the new tokens up to itself. That one rule covers prefill, chunked
prefill (a chunk attends to the chunks before it), decode (one query token) and, later, prefix-cache
hits and speculative verification.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Device tensors describing one step's flat batch. Built only by the ModelRunner.

    Attributes:
        slot_mapping: [num_tokens] int64, cache slot of each new token.
        query_start_loc: [num_seqs + 1] int32, cumulative new-token counts (cu_seqlens_q).
        seq_lens: [num_seqs] int32, context length of each sequence *after* this step
            (cached prefix + new tokens), i.e. the keys each sequence's last query sees.
        block_tables: [num_seqs, max_num_blocks_per_seq] int32, padded with 0 (never read past seq_lens).
        max_query_len: host int, max new tokens of one sequence in this step.
        max_seq_len: host int, max of seq_lens.
        seq_lens_cpu: host list of seq_lens (the pure-torch path loops over sequences).
        query_lens_cpu: host list of new-token counts.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Writes this step's k/v into the paged cache and computes attention for the new tokens.

    Implementations must be exact (up to floating-point reassociation) against ``TorchAttentionBackend``.
    """

    name: str = "abstract"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], this step's k/v already in
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attention only, for callers that already wrote k/v (e.g. the fused RoPE + cache-store kernel)."""

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store this step's k/v at ``meta.slot_mapping``, then attend."""
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new k/v rows ([num_tokens, num_kv_heads, head_dim]) into the cache at ``slot_mapping``."""
    num_blocks, block_size = k_cache.shape[:2]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    """Read one sequence's first ``seq_len`` cached rows through its block table."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [num_blocks, block_size, H_kv, D]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def ref_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Exact paged attention in plain torch (the reference every kernel is tested against).

    Args:
        q: [num_tokens, num_heads, head_dim] new-token queries.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], already holding this step's k/v.
        meta: the step's AttentionMetadata (host lists are used).
        scale: softmax scale, usually 1/sqrt(head_dim).

    Returns:
        [num_tokens, num_heads, head_dim] in q's dtype; the softmax is computed in fp32.
    """
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        qi = q[start:start + q_len].float()  # [q_len, H, D]
        ki = gather_kv(k_cache, meta.block_tables[i], seq_len).float()  # [seq_len, H_kv, D]
        vi = gather_kv(v_cache, meta.block_tables[i], seq_len).float()
        ki = ki.repeat_interleave(group, dim=1)  # [seq_len, H, D]
        vi = vi.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale  # [H, q_len, seq_len]
        # Query j (0-based within the chunk) sits at absolute position seq_len - q_len + j.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        mask = k_pos[None, :] > q_pos[:, None]  # [q_len, seq_len]
        scores.masked_fill_(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", probs, vi).to(q.dtype)
        start += q_len
    return out


def _decode_attention_batched(
    q: torch.Tensor,  # [N, H, D], one query per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [N, max_blocks]
    seq_lens: torch.Tensor,  # [N]
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """All decode rows at once: gather each table's blocks, pad to ``max_seq_len``, mask the padding."""
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = (max_seq_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long()
    k = k_cache[table].reshape(n, num_blocks * block_size, num_kv_heads, head_dim)  # [N, L, H_kv, D]
    v = v_cache[table].reshape(n, num_blocks * block_size, num_kv_heads, head_dim)
    qg = q.float().reshape(n, num_kv_heads, group, head_dim)  # query heads grouped by their KV head
    scores = torch.einsum("nhgd,nlhd->nhgl", qg, k.float()) * scale  # [N, H_kv, G, L]
    pad = torch.arange(k.shape[1], device=q.device)[None, :] >= seq_lens[:, None]  # [N, L]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Slots past seq_len may hold stale values (even inf/NaN from a freed request); 0 * NaN is NaN.
    v = v.masked_fill(pad[:, :, None, None], 0.0)
    out = torch.einsum("nhgl,nlhd->nhgd", probs, v.float())
    return out.reshape(n, num_heads, head_dim).to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    """Exact pure-torch paged attention (the CPU path).

    Decode rows (one new token) are computed together on padded, masked KV; rows with several new
    tokens (prefill chunks) go one sequence at a time through ``scaled_dot_product_attention`` with a
    mask that lets the chunk see its cached prefix and itself causally.
    """

    name = "torch"

    def attend(self, q, k_cache, v_cache, meta):
        out = torch.empty_like(q)
        qlens = meta.query_lens_cpu
        decode_rows = [i for i, n in enumerate(qlens) if n == 1]
        if decode_rows:
            # Decode rows, by length, in groups whose longest context is at most 1.5x the shortest, so
            # padding to the group's longest wastes little (ragged batches otherwise pad to the longest).
            decode_rows.sort(key=lambda i: meta.seq_lens_cpu[i])
            groups: list[list[int]] = []
            for i in decode_rows:
                if groups and meta.seq_lens_cpu[i] <= 1.5 * meta.seq_lens_cpu[groups[-1][0]] + 16:
                    groups[-1].append(i)
                else:
                    groups.append([i])
            first_token = [0]
            for n in qlens:
                first_token.append(first_token[-1] + n)
            for g in groups:
                sel = torch.tensor(g, dtype=torch.long, device=q.device)
                rows = torch.tensor([first_token[i] for i in g], dtype=torch.long, device=q.device)
                max_len = meta.seq_lens_cpu[g[-1]]
                out[rows] = _decode_attention_batched(q[rows], k_cache, v_cache, meta.block_tables[sel],
                                                      meta.seq_lens[sel], max_len, self.scale)
        start = 0
        group = self.num_heads // self.num_kv_heads
        for i, (q_len, seq_len) in enumerate(zip(qlens, meta.seq_lens_cpu, strict=True)):
            if q_len > 1:
                qi = q[start:start + q_len].transpose(0, 1)  # [H, q_len, D]
                ki = gather_kv(k_cache, meta.block_tables[i], seq_len).transpose(0, 1)  # [H_kv, L, D]
                vi = gather_kv(v_cache, meta.block_tables[i], seq_len).transpose(0, 1)
                if group > 1:
                    ki = ki.repeat_interleave(group, dim=0)
                    vi = vi.repeat_interleave(group, dim=0)
                q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
                k_pos = torch.arange(seq_len, device=q.device)
                mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, L], True = attend
                o = torch.nn.functional.scaled_dot_product_attention(
                    qi, ki.to(q.dtype), vi.to(q.dtype), attn_mask=mask, scale=self.scale
                )
                out[start:start + q_len] = o.transpose(0, 1)
            start += q_len
        return out


_BACKENDS: dict[str, str] = {
    "torch": "roofline.layers.attention:TorchAttentionBackend",
    "triton": "roofline.layers.triton_attention:TritonAttentionBackend",
}


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """Look up a backend class by name; GPU backends import lazily.

    Raises:
        ValueError: unknown name (lists the registered ones).
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; registered: {', '.join(sorted(_BACKENDS))}")
    import importlib

    module_name, cls_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)
