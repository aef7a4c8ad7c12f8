"""Triton paged-attention backend for CUDA: fused RoPE + cache store, split-KV flash-decoding for decode
steps, FlashAttention-style varlen prefill/extend for everything else.

Triton is imported here and in roofline/kernels only, so the core never needs it.

Qwen3's q_norm / k_norm (``QKNorm``) run inside ``rope_and_cache`` (one launch per layer for norm, RoPE and the
store); where the weights do not fit that kernel (a dtype other than q's, two different eps) the layer's RMSNorm
modules run first instead.

CUDA graphs: a decode step (``meta.max_query_len == 1``) reads no per-step host value. seq_lens and
block_tables are device tensors; the decode kernel's split count is fixed by static sizes (its own default,
``paged_decode_attention(num_splits=None)``): the batch size, the number of kv heads, the block table's width
times block_size (the longest context a captured graph can serve: the static block table has a fixed width),
the SM count and the tile of the kernel it picks. Each split's length is computed in-kernel from the true
seq_len, so one graph serves every context up to that width.

Token-tree verify steps: with ``ROOFLINE_TREE_VERIFY=decode`` (the default) a step in which every request verifies
comes laid out as decode rows, one per tree node (``InputPreparer``; ``meta.tree_lo`` / ``tree_bits``: each node
attends to the cached prefix, the root and its ancestors), which the decode kernel runs with the plain decode
step's arithmetic and the CUDA graphs replay: with a tree proposer the graphs are captured with the mask's inputs
(``init_capture(tree_rows=True)``; a plain step replays them with every key visible, the same arithmetic). Any
other step with a tree (``meta.tree_mask``), and every tree step with ``=prefill``, runs the prefill kernel with
the ancestor mask, eager. On an H100 (2026-12-05) bf16 trees through the prefill path were greedy-identical to
plain on 1 of 8 prompts, chains (decode rows) on 8 of 8.

Quantized caches: the cache's scale tensors go to the store kernel (which quantizes) and to both attention
kernels (which dequantize in registers); they are allocated once with the pool, so captured graphs read
them like k/v.
"""

from __future__ import annotations

import os

import torch

from roofline.attention.backend import TREE_LO_NONE, AttentionBackend, AttentionMetadata, QKNorm
from roofline.attention.kv_cache import KVCache
from roofline.kernels.common import KV_QUANT_NONE, KV_QUANT_PER_HEAD, KV_QUANT_PER_TOKEN
from roofline.kernels.decode_attention import (
    DEFAULT_VARIANT,
    paged_decode_attention,
)
from roofline.kernels.gluon_decode import decode_kernel_choice
from roofline.kernels.gluon_prefill import choose_prefill_kernel
from roofline.kernels.rope_cache import rope_and_cache

TREE_VERIFY_ENV = "ROOFLINE_TREE_VERIFY"
TREE_VERIFY_MODES = ("prefill", "decode")


def tree_verify_mode() -> str:
    """``ROOFLINE_TREE_VERIFY``: "decode" (default) or "prefill" (see the module docstring).

    Raises:
        ValueError: another value (names the allowed ones)."""
    mode = os.environ.get(TREE_VERIFY_ENV, "decode").strip().lower()
    if mode not in TREE_VERIFY_MODES:
        raise ValueError(f"{TREE_VERIFY_ENV}={mode!r}: must be one of {TREE_VERIFY_MODES}")
    return mode


class TritonAttentionBackend(AttentionBackend):
    """``decode_num_splits`` (None = the kernel's own, see module docstring) may be set to pin the split count, and
    ``decode_variant`` (None = ``DEFAULT_VARIANT`` of the cache format; "old", "mma" or "fma") the decode
    kernel's stage 1 (``roofline.kernels.decode_attention``). Set both before CUDA graphs are captured."""

    name = "triton"
    supports_cuda_graphs = True
    supports_tree_mask = True  # paged_prefill_attention(tree_mask=...)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.decode_num_splits: int | None = None
        self.decode_variant: str | None = None
        self._static: dict[str, torch.Tensor] = {}
        # Prefill/extend kernel, chosen once (ROOFLINE_PREFILL_KERNEL, default auto: Gluon on sm_90, else Triton;
        # roofline.kernels.gluon_prefill, which falls back to Triton per call where it does not apply).
        self.prefill_attention = choose_prefill_kernel()
        # The decode kernel family for quantized caches, also chosen once (ROOFLINE_DECODE_KERNEL; the kernel
        # itself still falls back per call where the Gluon kernel does not apply): no environment read per layer.
        self.decode_kernel = decode_kernel_choice()
        self.tree_as_decode_rows = tree_verify_mode() == "decode"  # AttentionBackend.tree_as_decode_rows

    def decode_variant_for(self, cache_dtype: torch.dtype | None) -> str:
        """The decode kernel variant for a cache of ``cache_dtype`` (None: a 16-bit cache)."""
        if self.decode_variant is not None:
            return self.decode_variant
        quant = {torch.int8: KV_QUANT_PER_TOKEN, torch.float8_e4m3fn: KV_QUANT_PER_HEAD}.get(cache_dtype,
                                                                                             KV_QUANT_NONE)
        return DEFAULT_VARIANT[quant]

    def forward(self, q, k, v, positions, cache: KVCache, meta, qk_norm: QKNorm | None = None):
        if self.is_calibrating:
            return self.calibration_forward(q, k, v, positions, cache, meta, qk_norm)
        ks, vs = cache.k_scale, cache.v_scale
        norm = {}
        if qk_norm is not None:
            wq, wk = qk_norm.q_norm.weight, qk_norm.k_norm.weight
            if wq.dtype == wk.dtype == q.dtype == k.dtype and qk_norm.q_norm.eps == qk_norm.k_norm.eps:
                norm = dict(q_norm_weight=wq, k_norm_weight=wk, norm_eps=qk_norm.q_norm.eps)  # fused below
            else:
                q, k = self.apply_qk_norm(q, k, qk_norm)
        rope_and_cache(q, k, v, positions, self.rotary.cos_sin_cache, cache.k, cache.v, meta.slot_mapping, ks, vs,
                       **norm)
        if meta.max_query_len == 1:
            # Decode: one query per sequence, q rows are sequences in order.
            # num_splits None: the kernel's static choice for the kernel and tile it picks (the Gluon kernel's
            # 1-warp tile takes 4x the splits of the Triton kernels' 4-warp one).
            # tree_lo / tree_bits: a tree's nodes as decode rows (or a graph captured for them), None otherwise.
            return paged_decode_attention(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, self.scale,
                                          num_splits=self.decode_num_splits, k_scale=ks, v_scale=vs,
                                          decode_kernel=self.decode_kernel,
                                          # None: the kernel's own pick (gluon for int8/fp8 on sm_90)
                                          variant=self.decode_variant, tree_lo=meta.tree_lo,
                                          tree_bits=meta.tree_bits)
        # A tree-verification step's ancestor bitmasks ([num_seqs, <= 64] int64; prefill_attention's docstring).
        # The Gluon kernel hands a tree mask to the Triton kernel (gluon_prefill's fallbacks).
        return self.prefill_attention(q, cache.k, cache.v, meta, self.scale, k_scale=ks, v_scale=vs,
                                      tree_mask=meta.tree_mask)

    # ------------------------------------------------------------------------------ CUDA graphs

    def init_capture(self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device,
                     tree_rows: bool = False) -> None:
        """Static buffers of the graphs; with ``tree_rows`` also ``tree_lo`` / ``tree_bits``, so that a tree
        verify step's decode rows replay the graphs (a plain step's rows then see every key)."""
        n = max_batch_size
        self._static = dict(
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
            seq_lens=torch.zeros(n, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
            block_tables=torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device),
        )
        if tree_rows:
            self._static.update(tree_lo=torch.full((n,), TREE_LO_NONE, dtype=torch.int64, device=device),
                                tree_bits=torch.full((n,), -1, dtype=torch.int64, device=device))
        self._tree_rows_set = False  # whether tree_lo holds a tree step's rows (a plain step resets it first)

    def capture_metadata(self, batch_size: int) -> AttentionMetadata:
        s, bs = self._static, batch_size
        meta = AttentionMetadata(
            slot_mapping=s["slot_mapping"][:bs], query_start_loc=s["query_start_loc"][:bs + 1],
            seq_lens=s["seq_lens"][:bs], block_tables=s["block_tables"][:bs], max_query_len=1,
            query_lens_cpu=[1] * bs, seq_lens_cpu=[1] * bs,  # placeholders: the decode path reads no host list
            tree_lo=s["tree_lo"][:bs] if "tree_lo" in s else None,
            tree_bits=s["tree_bits"][:bs] if "tree_bits" in s else None,
        )
        return self.build_metadata(meta)

    def prepare_replay(self, batch_size: int, meta: AttentionMetadata) -> None:
        s, n = self._static, meta.num_seqs
        s["slot_mapping"][:n].copy_(meta.slot_mapping, non_blocking=True)
        s["seq_lens"][:n].copy_(meta.seq_lens, non_blocking=True)
        s["block_tables"][:n, :meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        if meta.tree_lo is not None:
            s["tree_lo"][:n].copy_(meta.tree_lo, non_blocking=True)
            s["tree_bits"][:n].copy_(meta.tree_bits, non_blocking=True)
            self._tree_rows_set = True
        elif self._tree_rows_set:  # after a tree step: every key visible again (two launches, then none)
            s["tree_lo"].fill_(TREE_LO_NONE)
            s["tree_bits"].fill_(-1)
            self._tree_rows_set = False
        if n < batch_size:
            s["slot_mapping"][n:batch_size].fill_(-1)
            s["seq_lens"][n:batch_size].fill_(0)
