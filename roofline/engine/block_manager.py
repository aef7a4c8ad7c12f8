"""Paged KV-cache block allocator: fixed-size blocks, a free list and reference counts. Pure Python.

Blocks are handed out from the front of the free list and returned to its back, so ids are
deterministic (tests assert exact block ids). Reference counts let a block be shared (prefix caching,
later); a block returns to the free list only when its count reaches zero.
"""

from __future__ import annotations

from collections import Counter, deque

from roofline.engine.sequence import Sequence


class BlockManager:
    """Owns ``num_blocks`` blocks of ``block_size`` token slots.

    Mutates: ``seq.block_table`` (append on allocate, clear on free) and its own free list / ref counts.
    Not thread-safe: only the engine loop calls it.
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

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``seq`` must gain to hold its computed tokens plus ``num_new_tokens`` more."""
        needed = self.num_blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Extend ``seq.block_table`` to cover ``num_new_tokens`` more tokens; returns the new block ids.

        Raises:
            RuntimeError: not enough free blocks (callers check ``can_allocate`` first).
        """
        n = self.num_new_blocks(seq, num_new_tokens)
        if n > self.num_free_blocks:
            raise RuntimeError(f"need {n} blocks, only {self.num_free_blocks} free")
        new = [self.free_block_ids.popleft() for _ in range(n)]
        for b in new:
            assert self.ref_counts[b] == 0, f"block {b} on the free list has ref count {self.ref_counts[b]}"
            self.ref_counts[b] = 1
        seq.block_table.extend(new)
        return new

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks whose count reaches zero return to the free list.

        Raises:
            RuntimeError: a block in the table is not held that often (a double free); nothing changes then.
        """
        for b, n in Counter(seq.block_table).items():
            if self.ref_counts[b] < n:
                raise RuntimeError(f"double free of block {b}")
        for b in seq.block_table:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_block_ids.append(b)
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        """Cache slot of token ``position`` of ``seq`` (block_id * block_size + offset)."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def check_invariants(self, live: list[Sequence]) -> None:
        """Every block is either free (count 0) or referenced exactly as often as live tables hold it."""
        counts = [0] * self.num_blocks
        for s in live:
            for b in s.block_table:
                counts[b] += 1
        free = set(self.free_block_ids)
        assert len(free) == len(self.free_block_ids), "a block is on the free list twice"
        for b in range(self.num_blocks):
            assert counts[b] == self.ref_counts[b], f"block {b}: {counts[b]} holders, ref count {self.ref_counts[b]}"
            assert (b in free) == (counts[b] == 0), f"block {b}: free={b in free} but {counts[b]} holders"
