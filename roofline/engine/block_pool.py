"""The paged KV cache's blocks: a free list and reference counts. Pure Python (no torch).

Blocks are handed out from the front of the free list and returned to its back, so ids are deterministic
(tests assert exact block ids). A block may be held by several owners at once: sequences (through their
block tables; the prompt blocks of ``n > 1`` samples and prefix-cache hits are shared) and the prefix cache
(``RadixCache``, one reference per block in its tree). A block returns to the free list only when its count
reaches zero.

With a prefix cache attached, a block that only the cache holds, in a node no running sequence has locked,
is *evictable*: it counts as free (``num_free_blocks``, ``can_allocate``) and is taken back from the cache,
least recently used leaf first, when the free list runs short. So eviction always happens before the
scheduler has to preempt anything.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from roofline.engine.radix_cache import RadixCache


class BlockHolder(Protocol):
    """What the pool reads and writes of a sequence (``Sequence``, or scratch holders of other callers)."""

    block_table: list[int]
    num_computed_tokens: int


class BlockPool:
    """Owns ``num_blocks`` blocks of ``block_size`` token slots.

    Mutates: holders' ``block_table`` (append on allocate, clear on free), its free list and ref counts, and
    (through ``prefix_cache.evict``) the prefix cache when free blocks run short. Not thread-safe: only the
    engine loop calls it.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts: list[int] = [0] * num_blocks
        self.prefix_cache: RadixCache | None = None  # set by RadixCache(pool)

    # ------------------------------------------------------------------------------ counts

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks held only by the prefix cache, in unlocked nodes: freed on demand."""
        return self.prefix_cache.num_evictable_blocks if self.prefix_cache is not None else 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get now: on the free list, or evictable from the prefix cache."""
        return len(self.free_block_ids) + self.num_evictable_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by sequences, in [0, 1]; evictable cached blocks count as free."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ------------------------------------------------------------------------------ blocks

    def get_new_blocks(self, n: int) -> list[int]:
        """Take ``n`` blocks off the free list (ref count 1 each), evicting from the prefix cache first if
        the free list is short.

        Raises:
            RuntimeError: fewer than ``n`` blocks free or evictable (callers check first); nothing changes.
        """
        short = n - len(self.free_block_ids)
        if short > 0:
            if short > self.num_evictable_blocks:
                raise RuntimeError(f"need {n} blocks, only {self.num_free_blocks} free or evictable")
            assert self.prefix_cache is not None
            self.prefix_cache.evict(short)
        new = [self.free_block_ids.popleft() for _ in range(n)]
        for b in new:
            assert self.ref_counts[b] == 0, f"block {b} on the free list has ref count {self.ref_counts[b]}"
            self.ref_counts[b] = 1
        return new

    def incref(self, block_ids: list[int]) -> None:
        """One more holder for each block (each must be held already: a free block cannot be shared).

        Raises:
            RuntimeError: a block is free; nothing changes then.
        """
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"cannot share block {b}: it is free")
        for b in block_ids:
            self.ref_counts[b] += 1

    def decref(self, block_ids: list[int]) -> None:
        """One holder fewer for each block; blocks whose count reaches zero go to the back of the free list.

        Raises:
            RuntimeError: a block is released more often than it is held (a double free); nothing changes.
        """
        for b, n in Counter(block_ids).items():
            if self.ref_counts[b] < n:
                raise RuntimeError(f"double free of block {b} (ref count {self.ref_counts[b]}, released {n}x)")
        for b in block_ids:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_block_ids.append(b)

    # ------------------------------------------------------------------------------ block tables

    def num_new_blocks(self, seq: BlockHolder, num_new_tokens: int) -> int:
        """Blocks ``seq`` must gain to hold its computed tokens plus ``num_new_tokens`` more."""
        needed = self.num_blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: BlockHolder, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: BlockHolder, num_new_tokens: int) -> list[int]:
        """Extend ``seq.block_table`` to cover ``num_new_tokens`` more tokens; returns the new block ids.

        Raises:
            RuntimeError: not enough free or evictable blocks (callers check ``can_allocate`` first).
        """
        new = self.get_new_blocks(self.num_new_blocks(seq, num_new_tokens))
        seq.block_table.extend(new)
        return new

    def free(self, seq: BlockHolder) -> None:
        """Drop ``seq``'s references (shared blocks stay with their other holders) and clear its table.

        Raises:
            RuntimeError: a block in the table is not held that often (a double free); nothing changes then.
        """
        self.decref(seq.block_table)
        seq.block_table = []

    def slot(self, seq: BlockHolder, position: int) -> int:
        """Cache slot of token ``position`` of ``seq`` (block_id * block_size + offset)."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def check_invariants(self, live: list[BlockHolder]) -> None:
        """Every block is free (count 0, on the free list once) or referenced exactly as often as the live
        tables and the prefix cache hold it."""
        counts = [0] * self.num_blocks
        for s in live:
            for b in s.block_table:
                counts[b] += 1
        if self.prefix_cache is not None:
            for b in self.prefix_cache.all_block_ids():
                counts[b] += 1
        free = set(self.free_block_ids)
        assert len(free) == len(self.free_block_ids), "a block is on the free list twice"
        for b in range(self.num_blocks):
            assert counts[b] == self.ref_counts[b], f"block {b}: {counts[b]} holders, ref count {self.ref_counts[b]}"
            assert (b in free) == (counts[b] == 0), f"block {b}: free={b in free} but {counts[b]} holders"
