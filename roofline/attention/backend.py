"""The attention backend interface: it owns the KV cache, stores each step's k/v, and attends.

One step's batch is flat (no padding): the ``num_tokens`` new tokens of all sequences laid end to end,
sequence ``i`` owning rows ``query_start_loc[i]:query_start_loc[i+1]``. Each new token attends causally to
its sequence's cached prefix plus the new tokens up to itself. That one rule covers prefill, chunked
prefill (a chunk attends to the chunks before it), decode (one query token), prefix-cache hits and
speculative verification.

Per step the worker builds the common ``AttentionMetadata`` once and hands it to ``build_metadata``,
where a backend precomputes whatever it needs (gather indices, masks, split counts), so no layer does
Python work. Per layer, ``forward(q, k, v, positions, cache, meta, qk_norm)`` applies Qwen3's q/k norm when
the layer has one (``QKNorm``), RoPE, stores k/v at ``slot_mapping`` and attends. The norm belongs to the backend
so that one that can fuses it into its RoPE + store kernel (the Triton backend: ``rope_and_cache``, one launch
instead of two); any other applies the layer's RMSNorm modules first (``apply_qk_norm``).

CUDA graphs: a backend that can be captured sets ``supports_cuda_graphs`` and implements
``init_capture`` (static metadata buffers), ``capture_metadata`` (the metadata a captured graph reads)
and ``prepare_replay`` (copy a step's metadata into those buffers). The worker runs eager, with a log
line, for a backend that cannot be captured. A quantized cache's scale tensors are allocated once with
the pool (and fp8's are filled in place by calibration before capture), so graphs read them like k/v.

KV quantization (``--kv-cache-dtype int8 | fp8_e4m3``) lives in the backend: the store quantizes and the
attention dequantizes (formats in ``roofline.kernels.common``). fp8's static per-head scales come from
``calibrate_kv_scales``: one calibration forward during which every layer's ``forward`` records the
amax of its post-RoPE K and of V per KV head and attends to the fresh k/v (``calibration_forward``),
storing nothing.
"""

from __future__ import annotations

import importlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from roofline.attention.kv_cache import KVCache, KVCachePool
from roofline.kernels.common import FP8_E4M3_MAX
from roofline.kernels.rope_cache import ref_rotary
from roofline.layers.rotary import RotaryEmbedding

# fp8 scale = headroom x calibration amax / 448: values up to 2x the calibration amax still fit without
# saturating, while the smallest normal E4M3 value (2^-6 x scale) stays ~14,000x below that amax.
FP8_CALIBRATION_HEADROOM = 2.0
# ``AttentionMetadata.tree_lo`` of a decode row outside any tree (every key visible): past any context.
TREE_LO_NONE = 1 << 62


class QKNorm(NamedTuple):
    """Qwen3's per-head q_norm / k_norm (HF ``Qwen3Attention``): RMSNorm over head_dim of every query head and
    every key head, before RoPE. The layer's ``roofline.layers.norm.RMSNorm`` modules (``weight`` [head_dim],
    ``eps``; numerics HF ``Qwen3RMSNorm``'s), read at each call, so loading or casting the weights is seen."""

    q_norm: nn.Module
    k_norm: nn.Module


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
        tree_mask: None, or [num_seqs, W <= 64] int64 ancestor bitmasks of a speculative tree-verification step
            (the last min(q_len, W) rows of each sequence form its tree region; a row of -1 is plain causal;
            ``roofline.kernels.prefill_attention``'s docstring, "Tree mask"). A backend without
            ``supports_tree_mask`` refuses it.
        tree_lo, tree_bits: None, or [num_seqs] int64 each: a speculative tree verified as decode rows (every
            attention row one query row, ``max_query_len`` 1; ``InputPreparer`` lays them out for a backend with
            ``tree_as_decode_rows``): row i sees a key at position p >= tree_lo[i] only where bit p - tree_lo[i]
            of tree_bits[i] is set (a node's ancestors and itself); ``TREE_LO_NONE`` / -1: every key.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    tree_mask: torch.Tensor | None = None
    tree_lo: torch.Tensor | None = None
    tree_bits: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def slot_mapping(block_table: np.ndarray, token_rows: np.ndarray, positions: np.ndarray,
                 block_size: int) -> np.ndarray:
    """[T] int64 flat cache slots of tokens at ``positions`` [T] of rows ``token_rows`` [T] of ``block_table``
    [rows, max_blocks] (a position's block is ``block_table[row, position // block_size]``)."""
    return block_table[token_rows, positions // block_size].astype(np.int64) * block_size + positions % block_size


def paged_metadata(slots: np.ndarray, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
                   to_device: Callable[[str, np.ndarray], torch.Tensor] | torch.device,
                   tree_mask: np.ndarray | None = None,
                   tree_rows: tuple[np.ndarray, np.ndarray] | None = None) -> AttentionMetadata:
    """The one ``AttentionMetadata`` builder: host arrays in, device tensors and host lists out.

    Args:
        slots: [T] int64 cache slots (``slot_mapping``; negative: not stored).
        query_start_loc: [S + 1] int cumulative query counts of the S attention rows.
        seq_lens: [S] int keys each attention row's last query sees.
        block_tables: [S, max_blocks] int32 (each row's table, cut to the blocks any row reads).
        to_device: a device (plain copies), or ``to_device(name, array)`` (the worker's pinned staging, whose
            buffer names are ``slot_mapping``, ``query_start_loc``, ``seq_lens`` and ``block_tables``).
        tree_mask: optional [S, W <= 64] int64 ancestor bitmasks (``AttentionMetadata.tree_mask``).
        tree_rows: optional (tree_lo [S], tree_bits [S]) int64 of decode rows (``AttentionMetadata.tree_lo``).
    """
    if isinstance(to_device, torch.device):
        dev = to_device

        def to_device(_: str, a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev)
    counts = np.diff(query_start_loc)
    return AttentionMetadata(
        slot_mapping=to_device("slot_mapping", slots),
        query_start_loc=to_device("query_start_loc", query_start_loc.astype(np.int32)),
        seq_lens=to_device("seq_lens", seq_lens.astype(np.int32)),
        block_tables=to_device("block_tables", np.ascontiguousarray(block_tables)),
        max_query_len=int(counts.max()),
        query_lens_cpu=counts.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        tree_mask=None if tree_mask is None else to_device("tree_mask", np.ascontiguousarray(tree_mask, np.int64)),
        tree_lo=None if tree_rows is None else to_device("tree_lo", np.ascontiguousarray(tree_rows[0], np.int64)),
        tree_bits=None if tree_rows is None else to_device("tree_bits", np.ascontiguousarray(tree_rows[1], np.int64)),
    )


def tree_visibility(bits: torch.Tensor, q_len: int, seq_len: int) -> torch.Tensor:
    """[q_len, seq_len] bool, True = attend: one sequence's causal mask with its tree region applied, the rule
    of ``ref_paged_attention`` (``roofline.kernels.prefill_attention``): the last r = min(q_len, W) rows and keys
    form the region, region row j sees region key a iff a <= j and bit a of ``bits[j]`` is set.

    Args:
        bits: [W] int64 ancestor bitmasks of the sequence (-1: plain causal).
    """
    dev = bits.device
    q_pos = torch.arange(seq_len - q_len, seq_len, device=dev)
    visible = torch.arange(seq_len, device=dev)[None, :] <= q_pos[:, None]
    r = min(q_len, bits.shape[0])
    rel = torch.arange(r, device=dev)
    in_tree = ((bits[:r, None] >> rel[None, :]) & 1) != 0  # [r, r]
    visible[q_len - r:, seq_len - r:] &= in_tree
    return visible


def tree_decode_rows(meta: AttentionMetadata, num_rows: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A token-tree verify step (``meta.tree_mask``) as decode rows, one per query row, the form in which the CPU
    decode plan and the Triton backend's decode kernel run it: query row t of sequence i (q_i rows, L_i keys
    after the step) becomes a decode row over the first L_i - q_i + t + 1 cache positions of i's block table;
    the last r_i = min(q_i, W) rows of i, its tree region, see a key at position p >= lo = L_i - r_i only where
    bit p - lo of their ancestor mask is set. Equal to ``tree_visibility``'s rule.

    Returns:
        (block tables [M, max_blocks] int32 on the metadata's device, row lengths [M] int64, ``tree_lo`` [M]
        int64, ``tree_bits`` [M] int64 (-1: every key), the last three on the host), or None where the query
        rows do not add up to ``num_rows``.
    """
    q = np.asarray(meta.query_lens_cpu, dtype=np.int64)
    lens = np.asarray(meta.seq_lens_cpu, dtype=np.int64)
    if int(q.sum()) != num_rows or meta.tree_mask is None:
        return None
    seq = np.repeat(np.arange(len(q)), q)  # [M] each row's sequence
    first = np.repeat(np.cumsum(q) - q, q)
    t = np.arange(num_rows) - first  # row t of its sequence
    row_lens = np.repeat(lens - q, q) + t + 1
    mask = meta.tree_mask.cpu().numpy()
    r = np.minimum(q, mask.shape[1])
    j = t - np.repeat(q - r, q)  # region row, < 0 before the region
    bits = np.where(j >= 0, mask[seq, np.maximum(j, 0)], -1).astype(np.int64)
    lo = np.repeat(lens - r, q).astype(np.int64)
    table = meta.block_tables[torch.from_numpy(seq).to(meta.block_tables.device)].contiguous()
    return table, torch.from_numpy(row_lens), torch.from_numpy(lo), torch.from_numpy(bits)


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
    # Honours ``AttentionMetadata.tree_mask`` (speculative tree verification); one that does not raises in
    # ``build_metadata`` and a tree proposer falls back to a chain.
    supports_tree_mask: bool = False
    # Takes a tree verify step as decode rows (``AttentionMetadata.tree_lo`` / ``tree_bits``; ``InputPreparer``
    # lays a step out so when every request verifies), which its CUDA graphs can replay.
    tree_as_decode_rows: bool = False

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
        # id(layer cache) -> [k_amax, v_amax] per KV head, while a calibration forward runs (else None)
        self._calib_amax: dict[int, list[torch.Tensor]] | None = None

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
        """Precompute, once per step, what every layer's ``forward`` needs. Default: nothing.

        Raises:
            ValueError: a ``tree_mask`` on a backend without ``supports_tree_mask``."""
        self.check_tree_mask(meta)
        return meta

    def check_tree_mask(self, meta: AttentionMetadata) -> None:
        """Raises ValueError when ``meta`` carries a tree mask this backend cannot honour."""
        if meta.tree_mask is not None and not self.supports_tree_mask:
            raise ValueError(f"the {self.name} attention backend cannot apply a speculative tree's ancestor mask; "
                             f"use a chain (no tree_topk in speculative_config) or the torch/triton backend")

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], before RoPE
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], before RoPE
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        positions: torch.Tensor,  # [num_tokens] int64
        cache: KVCache,
        meta: AttentionMetadata,
        qk_norm: QKNorm | None = None,  # Qwen3's q/k RMSNorm, applied before RoPE (never skipped)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Norm q/k (with ``qk_norm``), rotate them, store k/v at ``meta.slot_mapping`` in ``cache``, then attend.
        May modify q and k."""

    @staticmethod
    def apply_qk_norm(q: torch.Tensor, k: torch.Tensor, qk_norm: QKNorm | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The unfused q/k norm: ``(qk_norm.q_norm(q), qk_norm.k_norm(k))`` through the RMSNorm modules (their
        own kernel dispatch; new tensors), or (q, k) as they are without ``qk_norm``."""
        if qk_norm is None:
            return q, k
        return qk_norm.q_norm(q), qk_norm.k_norm(k)

    # ------------------------------------------------------------------------------ fp8 scale calibration

    @property
    def is_calibrating(self) -> bool:
        return self._calib_amax is not None

    def calibrate_kv_scales(self, run_forward: Callable[[], object],
                            headroom: float = FP8_CALIBRATION_HEADROOM) -> dict[str, float]:
        """Set every layer's static fp8 per-head scales from one calibration forward.

        ``run_forward`` runs the model once over a prefill of one or more whole sequences (no cached prefix);
        meanwhile each layer's ``forward`` calls :meth:`calibration_forward`. Afterwards
        ``k_scale = max(headroom * amax(post-RoPE K) / 448, 2^-100)`` per (layer, KV head), and likewise V.
        Runs before CUDA graphs are captured; the scale tensors are updated in place.

        Returns:
            min/max of the K and V scales set, for the start-up log.

        Raises:
            RuntimeError: the pool is not fp8, or the forward did not reach every layer.
        """
        pool = self.kv_pool
        if pool is None or pool.dtype != torch.float8_e4m3fn:
            raise RuntimeError(f"calibrate_kv_scales needs an allocated fp8_e4m3 KV cache, got "
                               f"{None if pool is None else pool.dtype}")
        self._calib_amax = {}
        try:
            run_forward()
            amax = self._calib_amax
        finally:
            self._calib_amax = None
        missing = [i for i, c in enumerate(pool.caches) if id(c) not in amax]
        if missing:
            raise RuntimeError(f"the calibration forward did not reach layers {missing}")
        for c in pool.caches:
            for scale, a in zip((c.k_scale, c.v_scale), amax[id(c)], strict=True):
                assert scale is not None
                scale.copy_((a * (headroom / FP8_E4M3_MAX)).clamp_min(2.0 ** -100))
        ks = torch.stack([c.k_scale for c in pool.caches])  # type: ignore[misc]
        vs = torch.stack([c.v_scale for c in pool.caches])  # type: ignore[misc]
        return dict(k_min=float(ks.min()), k_max=float(ks.max()), v_min=float(vs.min()), v_max=float(vs.max()))

    def calibration_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            cache: KVCache, meta: AttentionMetadata, qk_norm: QKNorm | None = None) -> torch.Tensor:
        """One layer during calibration: record the per-KV-head amax of post-RoPE k (after ``qk_norm``, as
        stored) and of v for ``cache``'s layer, and attend causally to the fresh k/v of each sequence (exact, pure
        torch; nothing is stored).

        Raises:
            ValueError: a sequence with a cached prefix (calibration runs whole prompts only).
        """
        assert self._calib_amax is not None
        if meta.query_lens_cpu != meta.seq_lens_cpu:
            raise ValueError("a calibration forward runs whole sequences (query_lens == seq_lens), got "
                             f"query_lens {meta.query_lens_cpu}, seq_lens {meta.seq_lens_cpu}")
        q, k = self.apply_qk_norm(q, k, qk_norm)
        q, k = ref_rotary(positions, q, k, self.rotary.cos_sin_cache)
        seen = [k.float().abs().amax(dim=(0, 2)), v.float().abs().amax(dim=(0, 2))]  # [H_kv] each
        prev = self._calib_amax.get(id(cache))
        self._calib_amax[id(cache)] = seen if prev is None else [torch.maximum(a, b)
                                                                  for a, b in zip(prev, seen, strict=True)]
        group = self.num_heads // self.num_kv_heads
        out = torch.empty_like(q)
        start = 0
        for n in meta.query_lens_cpu:
            qi = q[start:start + n].transpose(0, 1)  # [H, n, D]
            ki = k[start:start + n].transpose(0, 1).repeat_interleave(group, dim=0)  # [H, n, D]
            vi = v[start:start + n].transpose(0, 1).repeat_interleave(group, dim=0)
            o = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=self.scale)
            out[start:start + n] = o.transpose(0, 1)
            start += n
        return out

    # ------------------------------------------------------------------------------ CUDA graphs

    def init_capture(self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device,
                     tree_rows: bool = False) -> None:
        """Allocate the graphs' static buffers (``tree_rows``: also a token tree's decode-row masks)."""
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
