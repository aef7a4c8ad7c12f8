"""Property tests: random start / insert / finish / abort / evict sequences on a RadixCache over a small
BlockPool never leak, double-free, evict a locked block, or hand out a block with the wrong KV.

Requests are a common head (or none) plus a random tail from a tiny alphabet, so prompts share prefixes of
many lengths and diverge inside blocks as well as on block boundaries. A model of the KV cache records, for every slot a request writes, the
token prefix that produced it (the KV of position p depends on tokens 0..p). Then:
- a request only ever writes blocks nobody else holds (a cached or shared block is never written again);
- every block a match hands out holds exactly the KV of the request's own prefix;
- the books balance after every operation (``BlockPool.check_invariants``, ``RadixCache.check_invariants``);
- at the end, with every request gone, every block is free or evictable, and evicting all frees all.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from roofline.engine.block_pool import BlockPool
from roofline.engine.radix_cache import RadixCache

# Common prompt heads (system prompts, few-shot examples), so that matches hit and edges split.
PREFIXES = [[], [0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 2, 0, 1, 2, 2, 2, 2, 1], [1, 1, 1, 1, 1, 1]]


class Request:
    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.node = None
        self.num_inserted_tokens = 0  # the verified count only grows (the lock never moves up the tree)


class RadixCacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    @initialize(block_size=st.sampled_from([1, 2, 3, 4]), num_blocks=st.integers(4, 16))
    def setup(self, block_size, num_blocks):
        self.pool = BlockPool(num_blocks, block_size)
        self.cache = RadixCache(self.pool)
        self.live: list[Request] = []
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> token prefix written there

    def write(self, req: Request, start: int, end: int) -> None:
        """The request computes positions [start, end): their KV lands in its own blocks."""
        bs = self.pool.block_size
        cached = set(self.cache.all_block_ids())
        for pos in range(start, end):
            block = req.block_table[pos // bs]
            assert self.pool.ref_counts[block] == 1 and block not in cached, f"writing shared block {block}"
            self.kv[(block, pos % bs)] = tuple(req.tokens[:pos + 1])

    def check_reads(self, req: Request, end: int) -> None:
        """Attention over positions [0, end) reads the KV of exactly this request's prefix."""
        bs = self.pool.block_size
        for pos in range(end):
            assert self.kv.get((req.block_table[pos // bs], pos % bs)) == tuple(req.tokens[:pos + 1]), \
                f"position {pos} reads the wrong KV"

    @rule(target=requests, prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 2), max_size=6))
    def start(self, prefix, tail):
        """Admission: match, lock, share the hit, allocate the rest (if it fits), compute the rest."""
        bs = self.pool.block_size
        tokens = (prefix + tail) or [0]
        req = Request(tokens)
        m = self.cache.match(tokens, max_tokens=len(tokens) - 1)
        assert m.num_tokens == len(m.block_ids) * bs and m.num_tokens <= len(tokens) - 1
        assert m.num_tokens == self.cache.match_length(tokens, len(tokens) - 1)
        need = self.pool.num_blocks_needed(len(tokens)) - len(m.block_ids)
        if need > self.pool.num_free_blocks - self.cache.num_evictable_on_path(m.node):
            return None  # does not fit (the scheduler would leave it waiting)
        self.cache.lock(m.node)
        req.node = m.node
        self.pool.incref(m.block_ids)
        req.block_table = list(m.block_ids)
        req.num_computed_tokens = req.num_inserted_tokens = m.num_tokens
        self.check_reads(req, m.num_tokens)
        req.block_table += self.pool.get_new_blocks(need)
        self.write(req, m.num_tokens, len(tokens))
        req.num_computed_tokens = len(tokens)
        self.check_reads(req, len(tokens))
        self.live.append(req)
        return req

    def release(self, req: Request, insert: bool) -> None:
        if req not in self.live:
            return
        if insert:
            node = self.cache.insert(req.tokens, req.block_table, len(req.tokens))
            self.cache.lock(node)
            self.cache.unlock(req.node)
            req.node = node
        self.cache.unlock(req.node)
        self.pool.free(req)
        self.live.remove(req)

    @rule(req=requests, num_tokens=st.integers(0, 14))
    def insert(self, req, num_tokens):
        """As a prefill chunk completes: cache a prefix and move the lock to its end."""
        if req not in self.live:
            return
        req.num_inserted_tokens = max(req.num_inserted_tokens, min(num_tokens, len(req.tokens)))
        node = self.cache.insert(req.tokens, req.block_table, req.num_inserted_tokens)
        self.cache.lock(node)
        self.cache.unlock(req.node)
        req.node = node

    @rule(req=consumes(requests))
    def finish(self, req):
        self.release(req, insert=True)

    @rule(req=consumes(requests))
    def abort(self, req):
        self.release(req, insert=False)

    @rule(num_blocks=st.integers(1, 6))
    def evict(self, num_blocks):
        evictable = self.cache.num_evictable_blocks
        free_before = len(self.pool.free_block_ids)
        freed = self.cache.evict(num_blocks)
        assert len(freed) == min(num_blocks, evictable)
        assert len(self.pool.free_block_ids) == free_before + len(freed)
        held = {b for r in self.live for b in r.block_table}
        assert not held & set(freed), "evicted a block a live request holds"
        assert all(self.pool.ref_counts[b] == 0 for b in freed)

    @invariant()
    def books_balance(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants(self.live)
        self.cache.check_invariants()
        assert min(self.pool.ref_counts) >= 0
        assert self.pool.num_free_blocks == len(self.pool.free_block_ids) + self.cache.num_evictable_blocks

    @precondition(lambda self: hasattr(self, "pool"))
    @invariant()
    def live_requests_keep_their_kv(self):
        for req in self.live:
            self.check_reads(req, req.num_computed_tokens)

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for req in list(self.live):
            self.release(req, insert=True)
        assert self.pool.num_free_blocks == self.pool.num_blocks  # free or evictable: nothing leaked
        self.cache.evict(self.pool.num_blocks)
        assert sorted(self.pool.free_block_ids) == list(range(self.pool.num_blocks))
        assert self.pool.ref_counts == [0] * self.pool.num_blocks
        assert self.cache.num_cached_blocks == 0 and self.cache.root.children == {}


RadixCacheMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixCache = RadixCacheMachine.TestCase
