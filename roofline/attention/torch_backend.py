"""Exact pure-torch paged attention: the CPU path, and the reference backend on GPUs.

``build_metadata`` does every piece of host work once per step:
- decode rows (one new token) are sorted by context length and cut into groups whose longest context is
  at most 1.5x the shortest (+16), so padding each group to its longest context wastes little on ragged
  batches; each group gets its gather indices [n, L] into the flat cache and its padding mask;
- each row with several new tokens (a prefill chunk) gets its key slots [seq_len] and its causal mask
  (the chunk sees its cached prefix and itself, causally).
Per layer, ``forward`` rotates q/k and stores k/v (``ref_rope_and_cache``), then runs one batched
softmax(QK^T)V per decode group and one ``scaled_dot_product_attention`` per prefill chunk.

Quantized caches (int8, fp8_e4m3; ``roofline.kernels.common``): the store quantizes with the ref twins of
the Triton store kernel, and both decode and prefill read K/V back from the cache and dequantize the rows
they gather (a prefill chunk attends to its own tokens as stored, not to the fresh k/v), so CPU and GPU
attend to the same values and quality figures measured here reflect the cache. On CPU, fp8 is emulated:
torch's float8_e4m3fn casts (round to nearest even, as the GPU's cvt.rn.satfinite), fp32 arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from roofline.attention.backend import AttentionBackend, AttentionMetadata
from roofline.attention.kv_cache import KVCache
from roofline.kernels.common import ref_dequantize
from roofline.kernels.rope_cache import ref_rope_and_cache, ref_rotary, ref_write_kv_rows


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [n] int64, the group's rows in the flat batch
    slots: torch.Tensor  # [n, L] int64, flat cache slots of each row's keys (L = the group's blocks x block_size;
    # padding positions repeat the row's first slot)
    pad: torch.Tensor  # [n, L] bool, True past the row's context (masked)


@dataclass
class PrefillChunk:
    start: int  # first row in the flat batch
    num_rows: int
    slots: torch.Tensor  # [seq_len] int64, flat cache slots of the sequence's keys
    mask: torch.Tensor  # [num_rows, seq_len] bool, True = attend


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Every row has a cache slot (no -1 padding), checked on the host: the store can skip the masked gather.
    all_slots_valid: bool = False


def _block_slots(block_tables: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """[n, W] block ids -> [n, num_blocks * block_size] flat slots of their first ``num_blocks`` blocks."""
    offs = torch.arange(block_size, device=block_tables.device)
    table = block_tables[:, :num_blocks].long()
    return (table[:, :, None] * block_size + offs).reshape(table.shape[0], num_blocks * block_size)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_cuda_graphs = False

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
        decode_rows = sorted((i for i, n in enumerate(qlens) if n == 1), key=lambda i: slens[i])
        groups: list[list[int]] = []
        for i in decode_rows:
            if groups and slens[i] <= 1.5 * slens[groups[-1][0]] + 16:
                groups[-1].append(i)
            else:
                groups.append([i])
        for g in groups:
            max_len = slens[g[-1]]
            num_blocks = (max_len + bs - 1) // bs
            sel = torch.tensor(g, dtype=torch.long, device=dev)
            slots = _block_slots(meta.block_tables[sel], num_blocks, bs)
            lens = meta.seq_lens[sel]
            pad = torch.arange(slots.shape[1], device=dev)[None, :] >= lens[:, None]
            # Padded keys read the row's first slot (written, so finite) instead of stale slots that may
            # hold inf/NaN from a freed request: their probability is exactly 0, so the sum is unchanged and
            # V needs no masking (0 * NaN would be NaN).
            slots = torch.where(pad, slots[:, :1], slots)
            rows = torch.tensor([first_row[i] for i in g], dtype=torch.long, device=dev)
            out.decode_groups.append(DecodeGroup(rows, slots, pad))
        for i, (q_len, seq_len) in enumerate(zip(qlens, slens, strict=True)):
            if q_len <= 1:
                continue
            num_blocks = (seq_len + bs - 1) // bs
            slots = _block_slots(meta.block_tables[i:i + 1], num_blocks, bs)[0, :seq_len]
            q_pos = torch.arange(seq_len - q_len, seq_len, device=dev)
            k_pos = torch.arange(seq_len, device=dev)
            out.prefills.append(PrefillChunk(first_row[i], q_len, slots, k_pos[None, :] <= q_pos[:, None]))
        return out

    def forward(self, q, k, v, positions, cache: KVCache, meta):
        if self.is_calibrating:
            return self.calibration_forward(q, k, v, positions, cache, meta)
        if not isinstance(meta, TorchAttentionMetadata):
            meta = self.build_metadata(meta)
        num_kv_heads, head_dim = self.num_kv_heads, self.head_dim
        group = self.num_heads // num_kv_heads
        k_flat = cache.k.view(-1, num_kv_heads, head_dim)  # [num_slots, H_kv, D]
        v_flat = cache.v.view(-1, num_kv_heads, head_dim)
        if meta.all_slots_valid:  # same values as ref_rope_and_cache, without its boolean-mask gathers
            q, k = ref_rotary(positions, q, k, self.rotary.cos_sin_cache)
            if cache.is_quantized:
                ref_write_kv_rows(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale, cache.v_scale)
            else:
                k_flat[meta.slot_mapping] = k.to(k_flat.dtype)
                v_flat[meta.slot_mapping] = v.to(v_flat.dtype)
        else:
            ref_rope_and_cache(q, k, v, positions, self.rotary.cos_sin_cache, cache.k, cache.v, meta.slot_mapping,
                               cache.k_scale, cache.v_scale)
        # int8: per-slot scales viewed [num_slots, H_kv] (gathered with the rows); fp8: per-head [H_kv].
        per_slot = cache.k_scale is not None and cache.k_scale.dim() == 3
        ks_flat = cache.k_scale.view(-1, num_kv_heads) if per_slot else cache.k_scale
        vs_flat = cache.v_scale.view(-1, num_kv_heads) if per_slot else cache.v_scale

        def gather(flat: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, dtype: torch.dtype):
            """Cache rows at ``slots`` (any shape), dequantized to ``dtype``: [*slots.shape, H_kv, D]."""
            return ref_dequantize(flat[slots], scales[slots] if per_slot else scales, dtype)

        out = torch.empty_like(q)
        for g in meta.decode_groups:
            n = g.rows.shape[0]
            qg = q[g.rows].float().reshape(n, num_kv_heads, group, head_dim)  # query heads by KV head
            kg = gather(k_flat, ks_flat, g.slots, torch.float32)  # [n, L, H_kv, D]
            vg = gather(v_flat, vs_flat, g.slots, torch.float32)
            scores = torch.einsum("nhgd,nlhd->nhgl", qg, kg) * self.scale  # [n, H_kv, G, L]
            scores.masked_fill_(g.pad[:, None, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            o = torch.einsum("nhgl,nlhd->nhgd", probs, vg)
            out[g.rows] = o.reshape(n, self.num_heads, head_dim).to(q.dtype)
        for p in meta.prefills:
            qi = q[p.start:p.start + p.num_rows].transpose(0, 1)  # [H, q_len, D]
            ki = gather(k_flat, ks_flat, p.slots, q.dtype).transpose(0, 1)  # [H_kv, L, D], read back from the cache
            vi = gather(v_flat, vs_flat, p.slots, q.dtype).transpose(0, 1)
            if group > 1:
                ki = ki.repeat_interleave(group, dim=0)
                vi = vi.repeat_interleave(group, dim=0)
            o = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=p.mask, scale=self.scale)
            out[p.start:p.start + p.num_rows] = o.transpose(0, 1)
        return out
