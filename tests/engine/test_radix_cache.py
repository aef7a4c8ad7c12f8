"""RadixCache over a BlockPool: exact block ids for match, insert, split, lock, LRU leaf-first eviction and
ref counts. Pure Python.

The tests follow the scheduler's protocol for one request: match, lock the matched node and share its
blocks, allocate the rest, insert the computed prefix and move the lock there, and at the end unlock and drop
the request's references (``Req`` below).
"""

from __future__ import annotations

import pytest

from roofline.engine.block_pool import BlockPool
from roofline.engine.radix_cache import RadixCache, RadixNode


class Req:
    """A request's block table and lock, driven like the Scheduler drives a Sequence."""

    def __init__(self, cache: RadixCache, tokens: list[int]):
        self.cache, self.pool, self.tokens = cache, cache.pool, tokens
        m = cache.match(tokens, max_tokens=len(tokens) - 1)  # at least one token is computed
        cache.lock(m.node)
        self.node: RadixNode = m.node
        self.pool.incref(m.block_ids)
        self.block_table = list(m.block_ids)
        self.num_cached_tokens = m.num_tokens
        self.block_table += self.pool.get_new_blocks(self.pool.num_blocks_needed(len(tokens)) - len(m.block_ids))

    def insert(self, num_tokens: int | None = None) -> None:
        node = self.cache.insert(self.tokens, self.block_table, len(self.tokens) if num_tokens is None else num_tokens)
        self.cache.lock(node)
        self.cache.unlock(self.node)
        self.node = node

    def release(self) -> None:
        self.cache.unlock(self.node)
        self.pool.decref(self.block_table)
        self.block_table = []


def make(num_blocks: int = 16, block_size: int = 4) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks, block_size)
    return pool, RadixCache(pool)


def edges(node: RadixNode) -> dict:
    """The tree below ``node`` as {first key token: (block ids, subtree)}."""
    return {key[0]: (child.value, edges(child)) for key, child in sorted(node.children.items())}


A = list(range(100, 110))  # 10 tokens: blocks of 4 hold tokens 0-3, 4-7 and 8-9 (partial)


def test_match_is_floored_to_whole_blocks_and_leaves_one_token_to_compute():
    pool, cache = make()
    a = Req(cache, A)
    assert (a.block_table, a.num_cached_tokens) == ([0, 1, 2], 0)
    a.insert()
    # Only the two full blocks are cached: the tail of the partial block 2 (tokens 8, 9) is not shared.
    assert edges(cache.root) == {100: ([0, 1], {})}
    assert pool.ref_counts[:3] == [2, 2, 1]
    assert cache.match(A) == ([0, 1], 8, cache.root.children[(100, 101, 102, 103)])
    assert cache.match(A[:7]).block_ids == [0]  # 7 tokens: one whole block
    assert cache.match(A[:8], max_tokens=7).num_tokens == 4  # a prompt of exactly 8 recomputes its last block
    assert cache.match(A[:3]) == ([], 0, cache.root)
    assert cache.match(A[:6] + [0, 0, 0, 0]).block_ids == [0]  # diverges inside block 1
    assert cache.match([1] + A[1:]).block_ids == []  # diverges inside block 0
    assert cache.match_length(A) == 8 and cache.match_length(A[:6] + [0, 0]) == 4
    # A second request with the same prompt shares blocks 0 and 1 and computes token 8 and 9 in its own block.
    b = Req(cache, A)
    assert (b.block_table, b.num_cached_tokens) == ([0, 1, 3], 8)
    assert pool.ref_counts[:4] == [3, 3, 1, 1]
    cache.check_invariants()
    pool.check_invariants([a, b])


def test_insert_splits_an_edge_where_two_prompts_diverge():
    pool, cache = make()
    a = Req(cache, A + [110, 111])  # 12 tokens, three full blocks
    a.insert()
    assert edges(cache.root) == {100: ([0, 1, 2], {})}
    b = Req(cache, A[:8] + [7, 7, 7, 7, 7])  # shares blocks 0 and 1, diverges in block 2
    assert (b.block_table, b.num_cached_tokens) == ([0, 1, 3, 4], 8)
    # The match split the edge after two blocks; a's lock now covers both parts.
    assert edges(cache.root) == {100: ([0, 1], {108: ([2], {})})}
    b.insert()
    assert edges(cache.root) == {100: ([0, 1], {7: ([3], {}), 108: ([2], {})})}
    upper = cache.root.children[(100, 101, 102, 103)]
    assert upper.lock_ref == 2 and [c.lock_ref for c in upper.children.values()] == [1, 1]
    c = Req(cache, [100, 5, 5, 5, 5, 5])  # diverges inside the first block: a new child of the root
    c.insert()
    assert {k: n.value for k, n in cache.root.children.items()} == {(100, 101, 102, 103): [0, 1], (100, 5, 5, 5): [5]}
    assert pool.ref_counts[:7] == [3, 3, 2, 2, 1, 2, 1]
    cache.check_invariants()
    pool.check_invariants([a, b, c])


def test_insert_keeps_the_cached_blocks_of_a_range_computed_twice():
    pool, cache = make()
    a, b = Req(cache, A), Req(cache, A)  # both admitted before either is cached: each computes the prompt
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4, 5])
    a.insert()
    b.insert()  # the range is cached already: b's blocks 3 and 4 stay private
    assert edges(cache.root) == {100: ([0, 1], {})}
    assert pool.ref_counts[:6] == [2, 2, 1, 1, 1, 1]
    assert a.node is b.node and a.node.lock_ref == 2
    b.release()
    assert list(pool.free_block_ids)[-3:] == [3, 4, 5]
    cache.check_invariants()
    pool.check_invariants([a])


def test_locked_blocks_are_not_evictable_and_released_ones_count_as_free():
    pool, cache = make(num_blocks=6)
    a = Req(cache, A)
    a.insert()
    assert (cache.num_cached_blocks, cache.num_evictable_blocks) == (2, 0)
    assert (len(pool.free_block_ids), pool.num_free_blocks, pool.usage) == (3, 3, 0.5)
    a.release()
    assert (cache.num_cached_blocks, cache.num_evictable_blocks) == (2, 2)
    assert list(pool.free_block_ids) == [3, 4, 5, 2]
    assert (pool.num_free_blocks, pool.usage) == (6, 0.0)  # evictable blocks count as free
    assert pool.ref_counts == [1, 1, 0, 0, 0, 0]
    assert cache.num_evictable_on_path(cache.match(A).node) == 2
    # A new request that needs every block evicts the cached ones (deepest first).
    big = Req(cache, list(range(24)))
    assert big.block_table == [3, 4, 5, 2, 1, 0]
    assert (cache.num_cached_blocks, cache.num_evicted_blocks, pool.num_free_blocks) == (0, 2, 0)
    with pytest.raises(RuntimeError, match="need 1 blocks, only 0 free or evictable"):
        pool.get_new_blocks(1)
    cache.check_invariants()
    pool.check_invariants([big])


def test_eviction_is_lru_over_unlocked_leaves_leaf_first():
    pool, cache = make(num_blocks=8, block_size=2)
    a = Req(cache, [1, 2, 3, 4, 0])
    a.insert()  # clock 2
    b = Req(cache, [5, 6, 7, 8, 0])
    b.insert()  # clock 4
    c = Req(cache, [1, 2, 9, 9, 0])  # shares block 0 with a; the match splits a's edge
    c.insert()  # clock 6
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 2], [3, 4, 5], [0, 6, 7])
    assert edges(cache.root) == {1: ([0], {3: ([1], {}), 9: ([6], {})}), 5: ([3, 4], {})}
    for r in (a, b, c):
        r.release()
    assert cache.num_evictable_blocks == 5
    assert list(pool.free_block_ids) == [2, 5, 7]
    # Leaves by last use: a's [1] (clock 2), b's [3, 4] (clock 4), c's [6] (clock 6). Block 0 is not a leaf.
    assert cache.evict(1) == [1]
    assert edges(cache.root) == {1: ([0], {9: ([6], {})}), 5: ([3, 4], {})}
    assert cache.evict(1) == [4]  # b's leaf loses its deepest block first, and keeps its prefix
    assert cache.match([5, 6, 7, 8]).block_ids == [3]
    assert cache.evict(2) == [3, 6]  # the rest of b, then c's [6]
    assert edges(cache.root) == {1: ([0], {})}  # now block 0 is a leaf
    assert cache.evict(5) == [0]  # all that is left
    assert list(pool.free_block_ids) == [2, 5, 7, 1, 4, 3, 6, 0]
    assert (cache.num_cached_blocks, cache.num_evictable_blocks, cache.num_evicted_blocks) == (0, 0, 5)
    assert pool.ref_counts == [0] * 8
    cache.check_invariants()


def test_lock_refreshes_recency_and_protects_the_whole_path():
    pool, cache = make(num_blocks=8, block_size=2)
    a = Req(cache, [1, 2, 3, 4, 0])
    a.insert()
    b = Req(cache, [5, 6, 7, 8, 0])
    b.insert()
    a.release()
    b.release()
    node_a = cache.match([1, 2, 3, 4]).node
    cache.lock(node_a)  # a's prefix in use again: most recent, and not evictable
    assert cache.num_evictable_blocks == 2
    assert cache.evict(8) == [4, 3]
    cache.unlock(node_a)
    assert cache.evict(8) == [1, 0]
    assert list(pool.free_block_ids) == [6, 7, 2, 5, 4, 3, 1, 0]
    cache.check_invariants()


def test_lru_order_ignores_matches_without_lock():
    pool, cache = make(num_blocks=8, block_size=2)
    d = Req(cache, [1, 1, 1, 1, 0])
    d.insert()
    c = Req(cache, [2, 2, 2, 2, 0])
    c.insert()
    d_blocks, c_blocks = d.block_table[:2], c.block_table[:2]
    c.release()
    d.release()
    cache.match([1, 1, 1, 1])  # a lookup (e.g. the lpm policy's) is not a use
    assert cache.evict(2) == d_blocks[::-1]
    assert cache.evict(2) == c_blocks[::-1]


def test_refcounts_never_go_negative():
    pool, cache = make()
    a = Req(cache, A)
    a.insert()
    node = a.node
    a.release()
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(node)  # a second unlock
    assert node.lock_ref == 0
    with pytest.raises(RuntimeError, match="double free of block 2"):
        pool.decref([2])  # block 2 (a's partial block) is free already
    with pytest.raises(RuntimeError, match="cannot share block 5: it is free"):
        pool.incref([5])
    # A reference taken without a lock (a broken protocol) stops eviction instead of freeing a block in use.
    pool.incref([1])
    with pytest.raises(RuntimeError, match="evicting block 1 of unlocked node .* 2 holders"):
        cache.evict(1)
    assert min(pool.ref_counts) == 0


def test_evicted_node_cannot_be_locked():
    pool, cache = make(num_blocks=4)
    a = Req(cache, A)
    a.insert()
    node = a.node
    a.release()
    cache.evict(2)
    with pytest.raises(RuntimeError, match="not in the tree"):
        cache.lock(node)


def test_insert_takes_the_count_of_verified_tokens():
    pool, cache = make()
    a = Req(cache, A + [110, 111])  # 12 tokens, 3 blocks
    a.insert(num_tokens=5)  # e.g. a chunk of 5 tokens completed (or 5 verified, the rest drafts)
    assert edges(cache.root) == {100: ([0], {})}
    a.insert(num_tokens=12)
    assert edges(cache.root) == {100: ([0], {104: ([1, 2], {})})}
    with pytest.raises(ValueError, match="2 blocks cannot hold 12 tokens"):
        cache.insert(A + [110, 111], [0, 1], 12)
    assert cache.insert([1, 2], [9], 2) is cache.root  # shorter than a block: nothing to cache
    cache.check_invariants()
    pool.check_invariants([a])


def test_pool_counts_and_allocation_with_the_cache():
    pool, cache = make(num_blocks=5)
    a = Req(cache, A)  # 3 blocks
    a.insert()
    a.release()
    assert (len(pool.free_block_ids), cache.num_evictable_blocks, pool.num_free_blocks) == (3, 2, 5)
    # 4 new blocks: 3 from the free list, then the LRU leaf's deepest block.
    assert pool.get_new_blocks(4) == [3, 4, 2, 1]
    assert cache.match(A).block_ids == [0]
    assert (pool.num_free_blocks, pool.num_evictable_blocks) == (1, 1)
