"""Paged attention on CPU against dense causal attention on contiguous K/V.

Three sequences of a GQA layer (6 query heads, 2 KV heads) are run step by step through scattered,
non-contiguous block tables the way the engine schedules them (prefill chunks, a whole prompt, then
decodes, mixed in one flat batch). Every output row must equal ``scaled_dot_product_attention`` over
the sequence's full contiguous K/V with a causal mask. Cache slots that no sequence owns hold NaN, so
reading past a sequence's length or outside its blocks would show. The backend's RoPE is made the
identity here (cos 1, sin 0) so the comparison is with plain attention; RoPE is checked in tests/kernels.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from roofline.attention.backend import AttentionMetadata
from roofline.attention.torch_backend import TorchAttentionBackend
from roofline.kernels.prefill_attention import ref_paged_attention
from roofline.kernels.rope_cache import ref_store_kv_cache

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 24
SEQ_LENS = [11, 5, 17]
# Per step, new tokens of each sequence (0 = not scheduled): chunked prefill, whole prompt, decodes.
STEPS = [[6, 5, 8], [4, 0, 8], [1, 0, 1], [0, 0, 0]]


def dense_causal(q, k, v):  # [L, H, D], [L, H_kv, D] -> [L, H, D]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True)
    return out.transpose(0, 1)


def make_meta(tables, starts, news):
    slots, qlens, seq_lens = [], [], []
    for table, start, n in zip(tables, starts, news, strict=True):
        if n == 0:
            continue
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, start + n)]
        qlens.append(n)
        seq_lens.append(start + n)
    width = max(len(t) for t in tables)
    rows = [t + [0] * (width - len(t)) for t, n in zip(tables, news, strict=True) if n]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(rows, dtype=torch.int32),
        max_query_len=max(qlens),
        seq_lens_cpu=seq_lens,
        query_lens_cpu=qlens,
    )


@pytest.mark.parametrize("impl", ["ref_paged_attention", "TorchAttentionBackend"])
def test_paged_attention_equals_dense_causal_attention(impl):
    torch.manual_seed(0)
    qs = [torch.randn(n, NUM_HEADS, HEAD_DIM) for n in SEQ_LENS]
    ks = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM) for n in SEQ_LENS]
    vs = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM) for n in SEQ_LENS]
    want = [dense_causal(q, k, v) for q, k, v in zip(qs, ks, vs, strict=True)]
    # Scattered tables: block ids in a shuffled order. Block 0, which pads the tables, belongs to no
    # sequence here and holds NaN, so reading the padding would show.
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    sizes = [math.ceil(n / BLOCK_SIZE) for n in SEQ_LENS]
    tables = [perm[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(len(SEQ_LENS))]
    assert 0 not in sum(tables, [])
    identity_rope = SimpleNamespace(cos_sin_cache=torch.cat([torch.ones(64, HEAD_DIM // 2),
                                                             torch.zeros(64, HEAD_DIM // 2)], dim=-1))
    backend = TorchAttentionBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, identity_rope)
    cache = backend.allocate_kv_cache(1, NUM_BLOCKS, BLOCK_SIZE, torch.float32, torch.device("cpu"))[0]
    k_cache, v_cache = cache.k, cache.v
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    computed = [0, 0, 0]
    for news in STEPS:
        if not any(news):
            break
        meta = make_meta(tables, computed, news)
        live = [i for i, n in enumerate(news) if n]
        q = torch.cat([qs[i][computed[i]:computed[i] + news[i]] for i in live])
        k = torch.cat([ks[i][computed[i]:computed[i] + news[i]] for i in live])
        v = torch.cat([vs[i][computed[i]:computed[i] + news[i]] for i in live])
        if impl == "ref_paged_attention":
            ref_store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
            out = ref_paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                      1.0 / math.sqrt(HEAD_DIM))
        else:
            positions = torch.cat([torch.arange(computed[i], computed[i] + news[i]) for i in live])
            out = backend.forward(q.clone(), k.clone(), v, positions, cache, backend.build_metadata(meta))
        row = 0
        for i in live:
            got = out[row:row + news[i]]
            torch.testing.assert_close(got, want[i][computed[i]:computed[i] + news[i]], rtol=1e-5, atol=1e-5)
            row += news[i]
            computed[i] += news[i]
    assert computed == SEQ_LENS
    # Each sequence's K/V landed in its own blocks, in order.
    for i, table in enumerate(tables):
        blocks = k_cache[table].reshape(-1, NUM_KV_HEADS, HEAD_DIM)
        assert torch.equal(blocks[:SEQ_LENS[i]], ks[i])


def test_negative_slot_is_not_stored():
    """Padding rows (slot -1, CUDA-graph padding) write nothing: in particular not the last slot."""
    k_cache = torch.zeros(2, 4, 1, 8)
    v_cache = torch.zeros(2, 4, 1, 8)
    k = torch.ones(2, 1, 8)
    ref_store_kv_cache(k, 2 * k, k_cache, v_cache, torch.tensor([3, -1]))
    assert k_cache.view(8, 1, 8)[3].eq(1).all() and v_cache.view(8, 1, 8)[3].eq(2).all()
    assert k_cache.view(8, 1, 8)[[0, 1, 2, 4, 5, 6, 7]].eq(0).all()  # slot 7 (where -1 would wrap) untouched
    assert v_cache.view(8, 1, 8)[7].eq(0).all()


def test_metadata_is_built_once_per_step(monkeypatch):
    """build_metadata precomputes the gather indices (the SDPA path) or the C++ kernel's rows, tables and lengths,
    never both; forward reuses them for every layer."""
    from roofline.kernels import cpu_paged_attention as cpa

    backend = TorchAttentionBackend(2, 1, 8, SimpleNamespace(cos_sin_cache=torch.zeros(16, 8)))
    backend.allocate_kv_cache(2, 4, 4, torch.float32, torch.device("cpu"))
    meta = make_meta([[1, 2], [3]], [5, 0], [1, 3])
    if cpa.unavailable_reason() is None:
        k = backend.build_metadata(meta)
        assert k.decode_groups == [] and k.decode_rows.tolist() == [0] and k.decode_lens.tolist() == [6]
        assert k.decode_tables.tolist() == [[1, 2]] and len(k.prefills) == 1
    monkeypatch.setattr(cpa, "ENABLED", False)  # the SDPA path's groups
    built = backend.build_metadata(meta)
    assert built.decode_rows is None
    assert [g.rows.tolist() for g in built.decode_groups] == [[0]]
    assert built.decode_groups[0].blocks.tolist() == [1, 2]  # context 6 = 2 blocks of 4, bucket 2
    assert built.decode_groups[0].pad.flatten().tolist() == [True] * 6 + [False] * 2
    assert built.decode_groups[0].stale.tolist() == [6, 7]  # the stale tail of block 2, zeroed after the gather
    assert [(p.start, p.num_rows, p.seq_len, p.blocks.tolist()) for p in built.prefills] == [(1, 3, 3, [3])]
    assert built.prefills[0].mask.tolist() == [[True, False, False], [True, True, False], [True, True, True]]
