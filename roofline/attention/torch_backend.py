"""Exact pure-torch paged attention: the CPU path, and the reference backend on GPUs.

``build_metadata`` does every piece of host work once per step (shared by all layers):
- decode rows (one new token) are padded to a length bucket that depends on **the row's own context
  length only** (``decode_bucket``: whole blocks, powers of two, then steps of 512 keys), and rows with the
  same bucket form one group (one SDPA call per group and layer: few buckets, few calls). A row's reductions
  (QK^T, softmax, PV) therefore run over the same padded length whatever its batch-mates are, so its output is
  bitwise the same alone and in any batch (issue 31 item 4: the former groups padded to their longest row,
  which moved fp8 greedy outputs with the batch);
- each group gets the block ids of its rows, [n * bucket] (padding blocks repeat the row's first block,
  which is written, so finite), its padding mask, and the flat positions of the stale tail of each row's
  last block (zeroed after the gather: a freed request may have left inf/NaN there, and 0 * NaN is NaN);
- each row with several new tokens (a prefill chunk) gets its block ids and its causal mask (the chunk
  sees its cached prefix and itself, causally).
Per layer, ``forward`` applies Qwen3's q/k norm if the layer has one (the layer's RMSNorm modules,
``apply_qk_norm``), rotates q/k and stores k/v (``ref_rope_and_cache``), gathers K/V as whole blocks
(one ``index_select`` per group on the [num_blocks, block_size * H_kv * D] view: no per-token index
arithmetic), and runs ``scaled_dot_product_attention`` (its flash CPU kernel, GQA without copies) per
decode group and per prefill chunk. On CPU with an unquantized fp32 or bf16 cache the decode rows run instead in
one call of the C++ kernel ``roofline.kernels.cpu_paged_attention``, which reads the blocks where they lie
(``decode_rows`` / ``decode_tables`` / ``decode_lens``); the groups are the path where it is not built (no C++
compiler) and for quantized caches.

Quantized caches (int8, fp8_e4m3; ``roofline.kernels.common``): the store quantizes with the ref twins of
the Triton store kernel, and both decode and prefill read K/V back from the cache and dequantize the rows
they gather (a prefill chunk attends to its own tokens as stored, not to the fresh k/v), so CPU and GPU
attend to the same values and quality figures measured here reflect the cache. On CPU, fp8 is emulated:
torch's float8_e4m3fn casts (round to nearest even, as the GPU's cvt.rn.satfinite), fp32 arithmetic.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from roofline.attention.backend import AttentionBackend, AttentionMetadata, tree_decode_rows, tree_visibility
from roofline.attention.kv_cache import KVCache
from roofline.kernels.common import ref_dequantize
from roofline.kernels.rope_cache import ref_rope_and_cache, ref_rotary, ref_write_kv_rows

logger = logging.getLogger(__name__)

# The widest step between decode buckets, in keys: a row pads by less than this (see ``decode_bucket``).
DECODE_BUCKET_MAX_STEP_KEYS = 512


def decode_bucket(num_blocks: int, block_size: int) -> int:
    """Blocks a decode row with ``num_blocks`` blocks of context is padded to: the next power of two until the
    step between buckets reaches ``DECODE_BUCKET_MAX_STEP_KEYS`` keys (rounded down to a power of two of
    blocks), then the next multiple of that step. Block size 16: 1, 2, 4, 8, 16, 32, 64, then 96, 128, 160, ...
    (steps of 32 blocks, 512 keys). A function of the row alone, so its padding never depends on the batch.

    Only the SDPA path uses buckets (quantized caches, or no C++ compiler for ``cpu_paged_attention``, which
    reads each row's own length and needs none). Why so coarse: that path runs one SDPA call (and its gathers: ~7 ops) per bucket per layer, and on a
    small shared CPU a call's fixed cost (each op a 2-thread parallel region) can outweigh hundreds of padded
    keys. The main job (32 ShareGPT rows, 60 to 1,000 keys; 4-5 groups instead of ~9, ~25% more keys gathered)
    against the former ~25% steps: 0.78x the decode step on an AMD EPYC (``bench/results/cpu-head-20261204b``),
    0.96x / 0.98x on an Intel Xeon with AMX, where the block gathers are memory-bound and padding costs more
    (``bench/results/cpu-bucket-20261204``). The cap bounds the padding of long rows (at most 511 keys past
    1,024 keys): padded work grows with the row, a call's fixed cost does not.

    Raises:
        ValueError: ``num_blocks`` < 1 or ``block_size`` < 1.
    """
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    max_step = 1 << max(DECODE_BUCKET_MAX_STEP_KEYS // block_size, 1).bit_length() - 1  # power of two, >= 1
    # Round up to a multiple of the step: half the next power of two (so the result is that power), or max_step.
    step = min(max_step, 1 << max((num_blocks - 1).bit_length() - 1, 0))
    return -(-num_blocks // step) * step


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [n] int64, the group's rows in the flat batch
    blocks: torch.Tensor  # [n * B] int64, each row's B block ids (B = the group's bucket; padding repeats block 0)
    pad: torch.Tensor  # [n, 1, 1, B * block_size] bool, True = attend (within the row's context)
    stale: torch.Tensor  # [k] int64, flat positions in [n * B * block_size] past a row's context inside its
    # last block (zeroed after the gather)


@dataclass
class PrefillChunk:
    start: int  # first row in the flat batch
    num_rows: int
    seq_len: int  # keys the chunk attends to (its cached prefix and itself)
    blocks: torch.Tensor  # [ceil(seq_len / block_size)] int64, the sequence's block ids
    mask: torch.Tensor  # [num_rows, seq_len] bool, True = attend


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # The decode rows for the C++ kernel (roofline.kernels.cpu_paged_attention): flat row indices [n], their
    # block tables [n, max_blocks] and context lengths [n], int64 (None: no decode row, or not on CPU).
    decode_rows: torch.Tensor | None = None
    decode_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    # A token-tree step's ancestor masks in decode-row form (``tree_decode_rows``), [n] int64 each, or None.
    decode_tree_lo: torch.Tensor | None = None
    decode_tree_bits: torch.Tensor | None = None
    # Every row has a cache slot (no -1 padding), checked on the host: the store can skip the masked gather.
    all_slots_valid: bool = False


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_cuda_graphs = False
    supports_tree_mask = True  # a prefill chunk's mask takes the tree region (``tree_visibility``)

    def build_metadata(self, meta: AttentionMetadata) -> TorchAttentionMetadata:
        assert self.kv_pool is not None
        bs = self.kv_pool.block_size
        dev = meta.block_tables.device
        qlens, slens = meta.query_lens_cpu, meta.seq_lens_cpu
        first_row = [0]
        for n in qlens:
            first_row.append(first_row[-1] + n)
        out = TorchAttentionMetadata(**{f: getattr(meta, f) for f in AttentionMetadata.__dataclass_fields__})
        # Free on CPU; on a GPU it would sync, and the triton backend handles the store there.
        out.all_slots_valid = dev.type == "cpu" and bool((meta.slot_mapping >= 0).all())
        tables = meta.block_tables.cpu() if dev.type != "cpu" else meta.block_tables
        cache0 = self.kv_pool.caches[0]
        if dev.type == "cpu" and cache0.is_quantized and self._use_cpu_kernel(cache0):
            # A quantized cache: every row, prefill chunks' and tree nodes' too, is one item of the C++ kernel
            # reading the codes (row t of a chunk over its first L - q_len + t + 1 keys), so a row's attention
            # depends on its own query and keys only, never on its batch, its chunking or a recompute after
            # preemption. (The codes themselves are as batch-invariant as the linears that wrote K and V: MKL's
            # sgemm past the fp32 linear's 32 rows is not, and a ~1e-6 difference can move a code.)
            num_rows = first_row[-1]
            tree = tree_decode_rows(meta, num_rows) if meta.tree_mask is not None else None
            if tree is not None:
                table, out.decode_lens, out.decode_tree_lo, out.decode_tree_bits = tree
                out.decode_tables = table.long().contiguous()
            else:
                q_lens = torch.tensor(qlens, dtype=torch.long)
                seq = torch.repeat_interleave(torch.arange(len(qlens)), q_lens)  # each row's sequence
                t = torch.arange(num_rows) - torch.tensor(first_row[:-1], dtype=torch.long)[seq]  # its row in it
                out.decode_lens = (torch.tensor(slens, dtype=torch.long) - q_lens)[seq] + t + 1
                out.decode_tables = tables.index_select(0, seq).long().contiguous()
            out.decode_rows = torch.arange(num_rows)
            return out
        dec = [i for i, n in enumerate(qlens) if n == 1]
        if dec and dev.type == "cpu" and self._use_cpu_kernel(cache0):
            # The C++ kernel reads each row's own blocks: no buckets, groups or padding masks this step.
            idx = torch.tensor(dec, dtype=torch.long)
            out.decode_rows = torch.tensor([first_row[i] for i in dec], dtype=torch.long)
            out.decode_tables = tables.index_select(0, idx).long().contiguous()
            out.decode_lens = torch.tensor([slens[i] for i in dec], dtype=torch.long)
            dec = []
        groups: dict[int, list[int]] = {}
        for i in dec:
            groups.setdefault(decode_bucket(-(-slens[i] // bs), bs), []).append(i)
        for bucket, rows in sorted(groups.items()):
            ids, stale = [], []
            for j, i in enumerate(rows):
                nb = -(-slens[i] // bs)
                row_ids = tables[i, :nb].tolist()
                ids += row_ids + row_ids[:1] * (bucket - nb)
                base = j * bucket * bs
                stale += range(base + slens[i], base + nb * bs)
            lens = torch.tensor([slens[i] for i in rows])
            keep = torch.arange(bucket * bs)[None, :] < lens[:, None]
            out.decode_groups.append(DecodeGroup(
                rows=torch.tensor([first_row[i] for i in rows], dtype=torch.long, device=dev),
                blocks=torch.tensor(ids, dtype=torch.long, device=dev),
                pad=keep[:, None, None, :].to(dev), stale=torch.tensor(stale, dtype=torch.long, device=dev)))
        for i, (q_len, seq_len) in enumerate(zip(qlens, slens, strict=True)):
            if q_len <= 1:
                continue
            nb = -(-seq_len // bs)
            if meta.tree_mask is not None:  # a tree-verification step: ancestors only inside the tree region
                mask = tree_visibility(meta.tree_mask[i].to(dev), q_len, seq_len)
            else:
                q_pos = torch.arange(seq_len - q_len, seq_len, device=dev)
                mask = torch.arange(seq_len, device=dev)[None, :] <= q_pos[:, None]
            out.prefills.append(PrefillChunk(first_row[i], q_len, seq_len, tables[i, :nb].long().to(dev), mask))
        return out

    def _use_cpu_kernel(self, cache: KVCache) -> bool:
        """The C++ decode kernel (``roofline.kernels.cpu_paged_attention``) for this step's decode rows (an fp32 or
        bf16 CPU cache), or for all its rows (int8 / fp8 codes); checked once per step, in ``build_metadata``. Its
        build failing is logged once and the SDPA path kept."""
        from roofline.kernels import cpu_paged_attention as cpa

        why = cpa.unavailable_reason()
        if why is not None:
            if not getattr(TorchAttentionBackend, "_kernel_note_logged", False):
                TorchAttentionBackend._kernel_note_logged = True
                logger.warning("CPU decode attention: the C++ kernel is not used (%s); gathers + SDPA instead", why)
            return False
        return cpa.supports(self.num_heads, self.head_dim, cache.k)

    def forward(self, q, k, v, positions, cache: KVCache, meta, qk_norm=None):
        if self.is_calibrating:
            return self.calibration_forward(q, k, v, positions, cache, meta, qk_norm)
        q, k = self.apply_qk_norm(q, k, qk_norm)
        if not isinstance(meta, TorchAttentionMetadata):
            meta = self.build_metadata(meta)
        num_kv_heads, head_dim = self.num_kv_heads, self.head_dim
        num_blocks, bs = cache.k.shape[:2]
        out = torch.empty_like(q)
        q32 = None
        if q.device.type == "cpu" and not cache.is_quantized:
            # RoPE and the store in one C++ pass; q comes back in fp32, what both attention paths below read.
            from roofline.kernels.cpu_paged_attention import rope_and_store

            q32 = rope_and_store(q, k, v, positions, self.rotary.cos_sin_cache, cache.k, cache.v,
                                 meta.slot_mapping, torch.float32)
        if q32 is not None:
            q = q32
        elif meta.all_slots_valid:  # same values as ref_rope_and_cache, without its boolean-mask gathers
            q, k = ref_rotary(positions, q, k, self.rotary.cos_sin_cache)
            if cache.is_quantized:
                ref_write_kv_rows(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale, cache.v_scale)
            else:
                cache.k.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = k.to(cache.k.dtype)
                cache.v.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = v.to(cache.v.dtype)
        else:
            ref_rope_and_cache(q, k, v, positions, self.rotary.cos_sin_cache, cache.k, cache.v, meta.slot_mapping,
                               cache.k_scale, cache.v_scale)
        # int8: per-slot scales [num_blocks, block_size, H_kv] (gathered with the blocks); fp8: per-head [H_kv].
        per_slot = cache.k_scale is not None and cache.k_scale.dim() == 3
        k_blocks = cache.k.view(num_blocks, -1)  # [num_blocks, block_size * H_kv * D]: one row per block
        v_blocks = cache.v.view(num_blocks, -1)

        # SDPA's dtype. On CPU, 16-bit attention runs in fp32: torch 2.13's CPU flash kernel took 7.0 ms in bf16
        # against 0.9 ms in fp32 (+0.4 ms for the casts) for 32 rows x 320 keys (9/3 heads, D 64, 1 thread, AMD
        # EPYC Zen 5, issue 32), which made `--dtype bfloat16` slower than fp32 at the main job's contexts.
        sdpa_dtype = torch.float32 if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) \
            else q.dtype

        def gather(blocks: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
            """The cache's ``blocks`` [m] as rows, dequantized to ``sdpa_dtype``: [m * block_size, H_kv, D]."""
            rows = codes.index_select(0, blocks).view(-1, num_kv_heads, head_dim)
            if scales is not None and per_slot:
                scales = scales.view(num_blocks, -1).index_select(0, blocks).view(-1, num_kv_heads)
            return ref_dequantize(rows, scales, sdpa_dtype) if scales is not None or rows.dtype != sdpa_dtype \
                else rows

        if meta.decode_rows is not None:
            # One C++ pass over the paged cache for every decode row: no gathers, no per-bucket SDPA; it writes
            # its rows of ``out`` in the model dtype (fp32 or bf16, rounded once).
            from roofline.kernels.cpu_paged_attention import paged_decode_attention

            direct = out.dtype in (torch.float32, torch.bfloat16)  # else (fp16) through an fp32 buffer
            dst = out if direct else torch.empty(q.shape, dtype=torch.float32)
            paged_decode_attention(q.float().contiguous(), cache.k, cache.v, meta.decode_tables, meta.decode_lens,
                                   meta.decode_rows, self.scale, dst, tree_lo=meta.decode_tree_lo,
                                   tree_bits=meta.decode_tree_bits, k_scale=cache.k_scale, v_scale=cache.v_scale)
            if not direct:
                out.index_copy_(0, meta.decode_rows, dst.index_select(0, meta.decode_rows).to(out.dtype))
        for g in meta.decode_groups:
            n = g.rows.shape[0]
            kg = gather(g.blocks, k_blocks, cache.k_scale)  # [n * L, H_kv, D]
            vg = gather(g.blocks, v_blocks, cache.v_scale)
            if g.stale.numel():
                kg.index_fill_(0, g.stale, 0)
                vg.index_fill_(0, g.stale, 0)
            kg = kg.view(n, -1, num_kv_heads, head_dim).transpose(1, 2)  # [n, H_kv, L, D] (a view)
            vg = vg.view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
            qg = q.index_select(0, g.rows)[:, :, None, :].to(sdpa_dtype)  # [n, H, 1, D]
            pad = g.pad
            if n == 1:
                # SDPA's CPU kernel reduces a batch of one in another order than a batch of several (torch 2.13,
                # 2 threads): a lone row is run as two (a stride-0 copy) so it matches itself in any batch.
                qg, kg, vg, pad = (t.expand(2, *t.shape[1:]) for t in (qg, kg, vg, pad))
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=pad, scale=self.scale, enable_gqa=True)
            out.index_copy_(0, g.rows, o[:n, :, 0].to(out.dtype))
        for p in meta.prefills:
            qi = q[p.start:p.start + p.num_rows].transpose(0, 1).to(sdpa_dtype)  # [H, q_len, D]
            # [H_kv, L, D], read back from the cache
            ki = gather(p.blocks, k_blocks, cache.k_scale)[:p.seq_len].transpose(0, 1)
            vi = gather(p.blocks, v_blocks, cache.v_scale)[:p.seq_len].transpose(0, 1)
            # torch 2.13 runs 3-D inputs through SDPA's math path (bmm + softmax) and 4-D ones (a leading batch dim
            # of 1) through its CPU flash kernel, 2.1-2.3x faster for these chunks (9/3 heads, D 64, 64-496 rows x
            # 496-1000 keys, Intel Xeon, 2026-12-04), within the same ~1e-6 of float64. The flash kernel's rows are
            # not bitwise independent of the chunking, which a quantized cache turns into code flips (the int8/fp8
            # batched-vs-alone and prefix-cache identities of tests/test_kv_cache_dtype.py), so those keep 3-D.
            flash = not cache.is_quantized
            o = F.scaled_dot_product_attention(qi[None] if flash else qi, ki[None] if flash else ki,
                                               vi[None] if flash else vi, attn_mask=p.mask, scale=self.scale,
                                               enable_gqa=True)
            o = o[0] if flash else o
            out[p.start:p.start + p.num_rows] = o.transpose(0, 1).to(out.dtype)
        return out
