"""CPU decode attention is batch-invariant: a row's output is bitwise the same alone and beside rows of other
context lengths, because its padded length is a function of its own context (``decode_bucket``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from roofline.attention.backend import AttentionMetadata
from roofline.attention.torch_backend import TorchAttentionBackend, decode_bucket

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 9, 3, 64, 16, 64


def test_decode_bucket_is_a_power_of_two_then_steps_of_512_keys():
    assert [decode_bucket(n, 16) for n in range(1, 18)] == [1, 2, 4, 4] + [8] * 4 + [16] * 8 + [32]
    assert [decode_bucket(n, 16) for n in (32, 33, 64, 65, 96, 97, 1000)] == [32, 64, 64, 96, 96, 128, 1024]
    assert [decode_bucket(n, 1) for n in (300, 512, 513, 1025, 1537)] == [512, 512, 1024, 1536, 2048]
    assert [decode_bucket(n, 48) for n in (9, 17, 25)] == [16, 24, 32]  # 512 // 48 = 10 -> steps of 8 blocks
    assert [decode_bucket(n, 1024) for n in (1, 2, 3, 7)] == [1, 2, 3, 7]  # blocks of 1,024 keys: no padding
    for bs in (1, 16, 48, 1024):
        for n in range(1, 600):
            b = decode_bucket(n, bs)
            assert n <= b < 2 * n or b == n == 1
            assert (b - n) * bs < 512  # at most 511 padded keys
            assert decode_bucket(b, bs) == b  # a bucket is its own bucket
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        decode_bucket(0, 16)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        decode_bucket(4, 0)


def _decode(backend, cache, q_rows, tables, lens):
    """One decode step (one new token per row, already in the cache at position len - 1)."""
    width = max(len(t) for t in tables)
    slots = [t[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE for t, n in zip(tables, lens, strict=True)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=1, seq_lens_cpu=list(lens), query_lens_cpu=[1] * len(lens))
    k_new = torch.stack([cache.k.view(-1, NUM_KV_HEADS, HEAD_DIM)[s] for s in slots])
    v_new = torch.stack([cache.v.view(-1, NUM_KV_HEADS, HEAD_DIM)[s] for s in slots])
    positions = torch.tensor([n - 1 for n in lens])
    return backend.forward(q_rows.clone(), k_new, v_new, positions, cache, backend.build_metadata(meta))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_row_is_bitwise_the_same_alone_and_batched(dtype):
    gen = torch.Generator().manual_seed(0)
    identity_rope = SimpleNamespace(cos_sin_cache=torch.cat([torch.ones(512, HEAD_DIM // 2),
                                                             torch.zeros(512, HEAD_DIM // 2)], dim=-1))
    backend = TorchAttentionBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, identity_rope)
    cache = backend.allocate_kv_cache(1, NUM_BLOCKS, BLOCK_SIZE, dtype, torch.device("cpu"))[0]
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    # Context lengths around the probe's (37): the former grouping padded it with 50 to 64 keys, and with 29.
    lens = [37, 50, 29, 5, 200, 37, 150]
    perm = torch.randperm(NUM_BLOCKS - 1, generator=gen).add(1).tolist()
    tables, used = [], 0
    for n in lens:
        nb = -(-n // BLOCK_SIZE)
        tables.append(perm[used:used + nb])
        used += nb
    q = torch.randn(len(lens), NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    batched = _decode(backend, cache, q, tables, lens)
    for i in (0, 1, 2, 4):
        alone = _decode(backend, cache, q[i:i + 1], tables[i:i + 1], lens[i:i + 1])
        assert torch.equal(alone[0], batched[i]), f"row {i} (context {lens[i]}) differs alone vs batched"
    # And it is attention: against a float64 softmax over the row's own keys.
    for i, n in enumerate(lens):
        k = cache.k[tables[i]].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n].double().repeat_interleave(3, dim=1)
        v = cache.v[tables[i]].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n].double().repeat_interleave(3, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[i].double(), k) / HEAD_DIM ** 0.5, dim=-1)
        want = torch.einsum("hl,lhd->hd", p, v)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(batched[i].double(), want, rtol=tol, atol=tol)
