"""BlockPool: exact block ids for allocate / free / reuse, can_allocate edges, errors and usage.

The free list hands blocks out from its front and takes freed blocks back at its back, so every id
below is determined by the order of calls.
"""

from __future__ import annotations

import pytest

from roofline.engine.block_pool import BlockPool
from roofline.engine.sequence import Sequence
from roofline.sampling_params import SamplingParams


def make_seq(num_prompt_tokens: int, num_computed_tokens: int = 0) -> Sequence:
    seq = Sequence("r", list(range(1, num_prompt_tokens + 1)), SamplingParams(), arrival_time=0.0)
    seq.num_computed_tokens = num_computed_tokens
    return seq


def test_allocate_hands_out_ids_from_the_front_in_order():
    bm = BlockPool(num_blocks=10, block_size=4)
    a, b = make_seq(9), make_seq(4)
    assert bm.allocate(a, 9) == [0, 1, 2]  # ceil(9 / 4) = 3 blocks
    assert bm.allocate(b, 4) == [3]  # exactly one full block
    assert a.block_table == [0, 1, 2]
    assert b.block_table == [3]
    assert list(bm.free_block_ids) == [4, 5, 6, 7, 8, 9]
    assert bm.ref_counts == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    bm.check_invariants([a, b])


def test_allocate_extends_only_past_the_last_partial_block():
    bm = BlockPool(num_blocks=10, block_size=4)
    seq = make_seq(5)
    assert bm.allocate(seq, 5) == [0, 1]  # slots 0..7, tokens 0..4 used
    seq.num_computed_tokens = 5
    # Tokens 5, 6, 7 still fit in block 1: nothing new.
    assert bm.num_new_blocks(seq, 3) == 0
    assert bm.allocate(seq, 3) == []
    # Token 8 starts block 3 of the table.
    assert bm.num_new_blocks(seq, 4) == 1
    assert bm.allocate(seq, 4) == [2]
    assert seq.block_table == [0, 1, 2]
    # A decode step at a block boundary: 12 computed, one new token needs a fourth block.
    seq.num_computed_tokens = 12
    assert bm.allocate(seq, 1) == [3]
    assert seq.block_table == [0, 1, 2, 3]
    bm.check_invariants([seq])


def test_freed_blocks_go_to_the_back_and_are_reused_last():
    bm = BlockPool(num_blocks=6, block_size=4)
    a, b, c = make_seq(8), make_seq(4), make_seq(4)
    assert bm.allocate(a, 8) == [0, 1]
    assert bm.allocate(b, 4) == [2]
    bm.free(a)
    assert a.block_table == []
    assert list(bm.free_block_ids) == [3, 4, 5, 0, 1]
    assert bm.ref_counts == [0, 0, 1, 0, 0, 0]
    # Never-used blocks come before the freed ones.
    assert bm.allocate(c, 4) == [3]
    d = make_seq(12)
    assert bm.allocate(d, 12) == [4, 5, 0]
    bm.free(b)
    assert list(bm.free_block_ids) == [1, 2]
    e = make_seq(8)
    assert bm.allocate(e, 8) == [1, 2]
    assert bm.num_free_blocks == 0
    bm.check_invariants([c, d, e])


def test_free_order_of_a_table_is_preserved():
    bm = BlockPool(num_blocks=4, block_size=2)
    a, b = make_seq(4), make_seq(4)
    bm.allocate(a, 4)  # [0, 1]
    bm.allocate(b, 4)  # [2, 3]
    bm.free(b)
    bm.free(a)
    assert list(bm.free_block_ids) == [2, 3, 0, 1]
    c = make_seq(6)
    assert bm.allocate(c, 6) == [2, 3, 0]


def test_can_allocate_edges():
    bm = BlockPool(num_blocks=3, block_size=4)
    seq = make_seq(12)
    assert bm.can_allocate(seq, 12)  # exactly the whole pool
    assert not bm.can_allocate(seq, 13)  # one token over
    assert bm.can_allocate(seq, 0)  # nothing needed
    bm.allocate(seq, 10)  # [0, 1, 2], 2 slots left in block 2
    seq.num_computed_tokens = 10
    assert bm.num_free_blocks == 0
    assert bm.can_allocate(seq, 2)  # fits in the partial last block
    assert not bm.can_allocate(seq, 3)
    other = make_seq(1)
    assert not bm.can_allocate(other, 1)
    assert bm.can_allocate(other, 0)


def test_allocate_without_room_raises_and_changes_nothing():
    bm = BlockPool(num_blocks=3, block_size=4)
    a, b = make_seq(8), make_seq(8)
    bm.allocate(a, 8)
    with pytest.raises(RuntimeError, match=r"need 2 blocks, only 1 free"):
        bm.allocate(b, 8)
    assert b.block_table == []
    assert list(bm.free_block_ids) == [2]
    bm.check_invariants([a, b])


def test_double_free_raises():
    bm = BlockPool(num_blocks=4, block_size=4)
    seq = make_seq(8)
    bm.allocate(seq, 8)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table  # a stale table freed again
    with pytest.raises(RuntimeError, match=r"double free of block 0"):
        bm.free(seq)
    # The failed free left the allocator untouched.
    assert list(bm.free_block_ids) == [2, 3, 0, 1]
    assert bm.ref_counts == [0, 0, 0, 0]


def test_double_free_of_a_later_block_changes_nothing():
    bm = BlockPool(num_blocks=4, block_size=4)
    a = make_seq(8)
    bm.allocate(a, 8)  # [0, 1]
    stale = make_seq(8)
    stale.block_table = [0, 2]  # block 2 was never allocated
    with pytest.raises(RuntimeError, match=r"double free of block 2"):
        bm.free(stale)
    assert bm.ref_counts == [1, 1, 0, 0]
    assert list(bm.free_block_ids) == [2, 3]
    bm.check_invariants([a])


def test_free_of_an_empty_table_is_a_no_op():
    bm = BlockPool(num_blocks=2, block_size=4)
    seq = make_seq(3)
    bm.free(seq)
    assert list(bm.free_block_ids) == [0, 1]


def test_usage_and_num_free_blocks():
    bm = BlockPool(num_blocks=8, block_size=4)
    assert bm.usage == 0.0
    a = make_seq(12)
    bm.allocate(a, 12)
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    b = make_seq(20)
    bm.allocate(b, 20)
    assert bm.usage == 1.0
    bm.free(a)
    assert bm.usage == pytest.approx(5 / 8)


def test_slot_mapping():
    bm = BlockPool(num_blocks=8, block_size=4)
    a, b = make_seq(4), make_seq(6)
    bm.allocate(a, 4)  # [0]
    bm.allocate(b, 6)  # [1, 2]
    assert [bm.slot(b, p) for p in range(6)] == [4, 5, 6, 7, 8, 9]
    bm.free(a)
    bm.allocate(b, 0)
    b.num_computed_tokens = 6
    bm.allocate(b, 3)  # tokens 6..8 -> block 2 (offsets 2, 3), then block 3
    assert b.block_table == [1, 2, 3]
    assert [bm.slot(b, p) for p in (6, 7, 8)] == [10, 11, 12]


def test_num_blocks_needed():
    bm = BlockPool(num_blocks=1, block_size=16)
    assert [bm.num_blocks_needed(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


@pytest.mark.parametrize(
    "num_blocks, block_size, message",
    [(0, 4, "num_blocks must be >= 1, got 0"), (4, 0, "block_size must be >= 1, got 0")],
)
def test_bad_sizes_raise(num_blocks, block_size, message):
    with pytest.raises(ValueError, match=message):
        BlockPool(num_blocks, block_size)


def test_check_invariants_catches_a_leak_and_a_foreign_reference():
    bm = BlockPool(num_blocks=4, block_size=4)
    a = make_seq(8)
    bm.allocate(a, 8)
    with pytest.raises(AssertionError, match="block 0: 0 holders, ref count 1"):
        bm.check_invariants([])  # a's blocks are held by nobody live: a leak
    intruder = make_seq(4)
    intruder.block_table = [3]
    with pytest.raises(AssertionError, match="block 3: 1 holders, ref count 0"):
        bm.check_invariants([a, intruder])
