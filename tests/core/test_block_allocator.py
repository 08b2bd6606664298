"""BlockAllocator: exhaustion, exact errors, reuse order, ref counts, owners, audits."""

from __future__ import annotations

import pytest

from paged_core import BlockAllocator, OutOfBlocksError


def test_allocate_to_exhaustion_then_out_of_blocks():
    alloc = BlockAllocator(10)
    first = alloc.allocate(5)
    assert alloc.num_free() == 5 and alloc.num_allocated() == 5
    second = alloc.allocate(5)
    assert alloc.num_free() == 0
    assert sorted(first + second) == list(range(10))
    with pytest.raises(OutOfBlocksError, match=r"cannot allocate 1 blocks: only 0 of 10 are free"):
        alloc.allocate(1)


def test_out_of_blocks_is_a_runtime_error_and_changes_nothing():
    alloc = BlockAllocator(4)
    alloc.allocate(3)
    assert issubclass(OutOfBlocksError, RuntimeError)
    with pytest.raises(RuntimeError):
        alloc.allocate(2)
    # all or nothing: the one free block is still there
    assert alloc.num_free() == 1
    assert alloc.allocate(1) == [3]


def test_can_allocate_matches_allocate():
    alloc = BlockAllocator(10)
    alloc.allocate(8)
    assert alloc.can_allocate(2)
    assert not alloc.can_allocate(3)
    assert not alloc.can_allocate(-1)


def test_freed_ids_are_reused_least_recently_freed_first():
    alloc = BlockAllocator(3)
    ids = alloc.allocate(3)
    assert ids == [0, 1, 2]
    for b in (2, 0, 1):
        alloc.free(b)
    assert alloc.num_free() == 3
    assert alloc.allocate(3) == [2, 0, 1]


def test_never_used_ids_come_before_freed_ones():
    alloc = BlockAllocator(4)
    a = alloc.allocate(2)
    alloc.free(a)
    assert alloc.allocate(4) == [2, 3, 0, 1]


def test_free_returns_the_ids_that_became_free():
    alloc = BlockAllocator(4)
    a, b = alloc.allocate(2)
    alloc.share(a)
    assert alloc.free([a, b]) == [b]
    assert alloc.free(a) == [a]


def test_double_free_is_a_value_error_and_changes_nothing():
    alloc = BlockAllocator(5)
    ids = alloc.allocate(3)
    alloc.free(ids)
    with pytest.raises(ValueError, match=rf"double free of block {ids[0]}: it is already free"):
        alloc.free(ids)
    assert alloc.num_free() == 5


def test_double_free_within_one_call_is_caught_before_any_change():
    alloc = BlockAllocator(5)
    a, b = alloc.allocate(2)
    with pytest.raises(ValueError, match=rf"double free of block {a}: freed 2 times in one call"):
        alloc.free([b, a, a])
    # b was not released either: the call changed nothing
    assert alloc.ref_count(a) == 1 and alloc.ref_count(b) == 1
    assert alloc.num_free() == 3


def test_free_of_never_allocated_block_is_a_value_error():
    alloc = BlockAllocator(5)
    alloc.allocate(1)
    with pytest.raises(ValueError, match=r"double free of block 3: it is already free"):
        alloc.free(3)


@pytest.mark.parametrize("bad", [-1, 5, 100])
def test_unknown_block_id_is_a_value_error(bad):
    alloc = BlockAllocator(5)
    alloc.allocate(5)
    with pytest.raises(ValueError, match=rf"unknown block id {bad}: valid ids are 0\.\.4"):
        alloc.free(bad)
    for call in (
        alloc.ref_count,
        alloc.is_free,
        alloc.owners,
        alloc.share,
        alloc.take,
        alloc.force_free,
    ):
        with pytest.raises(ValueError, match="unknown block id"):
            call(bad)
    assert alloc.num_free() == 0


def test_allocate_zero_returns_empty_and_changes_nothing():
    alloc = BlockAllocator(3)
    assert alloc.allocate(0) == []
    assert alloc.num_free() == 3
    assert alloc.allocate(3) == [0, 1, 2]


def test_negative_allocation_is_a_value_error():
    with pytest.raises(ValueError, match="negative"):
        BlockAllocator(3).allocate(-1)
    with pytest.raises(ValueError, match="total_blocks must be >= 0"):
        BlockAllocator(-1)


def test_empty_pool():
    alloc = BlockAllocator(0)
    assert alloc.num_free() == 0 and alloc.num_allocated() == 0
    assert alloc.can_allocate(0)
    assert not alloc.can_allocate(1)
    assert alloc.allocate(0) == []
    with pytest.raises(OutOfBlocksError, match="only 0 of 0 are free"):
        alloc.allocate(1)
    with pytest.raises(ValueError, match="unknown block id 0"):
        alloc.free(0)
    assert alloc.allocated_blocks() == []


def test_share_three_times_then_free_three_times():
    alloc = BlockAllocator(4)
    (b,) = alloc.allocate(1)
    alloc.share(b)
    alloc.share(b)
    assert alloc.ref_count(b) == 3
    assert alloc.free(b) == [] and alloc.ref_count(b) == 2 and not alloc.is_free(b)
    assert alloc.free(b) == [] and alloc.ref_count(b) == 1
    assert alloc.free(b) == [b] and alloc.ref_count(b) == 0 and alloc.is_free(b)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(b)


def test_share_of_a_free_block_is_a_value_error():
    alloc = BlockAllocator(2)
    with pytest.raises(ValueError, match="cannot share block 1: it is free"):
        alloc.share(1)


def test_owner_tracking():
    alloc = BlockAllocator(8)
    mine = alloc.allocate(3, owner=42)
    assert all(alloc.owners(b) == {42} for b in mine)
    alloc.free(mine[:2], owner=42)
    assert alloc.owners(mine[0]) == frozenset() and alloc.owners(mine[1]) == frozenset()
    assert alloc.owners(mine[2]) == {42}
    theirs = alloc.allocate(2, owner=99)
    assert [alloc.owners(b) for b in theirs] == [{99}, {99}]
    # sharing adds an owner; freeing that owner's reference removes it again
    alloc.share(mine[2], owner=7)
    assert alloc.owners(mine[2]) == {42, 7}
    alloc.free(mine[2], owner=42)
    assert alloc.owners(mine[2]) == {7}


def test_owners_is_a_copy():
    alloc = BlockAllocator(2)
    (b,) = alloc.allocate(1, owner=1)
    owners = alloc.owners(b)
    assert isinstance(owners, frozenset)
    assert alloc.owners(b) == {1}


def test_find_leaked_blocks():
    alloc = BlockAllocator(10)
    ones = alloc.allocate(5, owner=1)
    twos = alloc.allocate(3, owner=2)
    assert alloc.find_leaked_blocks({1}) == sorted(twos)
    assert alloc.find_leaked_blocks({1, 2}) == []
    assert alloc.find_leaked_blocks(set()) == sorted(ones + twos)
    # a block shared by a live owner is not leaked
    alloc.share(twos[0], owner=1)
    assert alloc.find_leaked_blocks({1}) == sorted(twos[1:])


def test_find_unreferenced_blocks():
    alloc = BlockAllocator(12)
    ids = alloc.allocate(10)
    assert alloc.find_unreferenced_blocks(ids[:7]) == sorted(ids[7:])
    assert alloc.find_unreferenced_blocks(ids) == []
    assert alloc.find_unreferenced_blocks([]) == sorted(ids)


def test_force_free():
    alloc = BlockAllocator(6)
    ids = alloc.allocate(5, owner=3)
    alloc.share(ids[0], owner=4)
    for b in ids:
        alloc.force_free(b)
    assert alloc.num_free() == 6
    assert all(alloc.ref_count(b) == 0 and alloc.owners(b) == frozenset() for b in ids)
    alloc.force_free(ids[0])  # already free: no error, no change
    assert alloc.num_free() == 6
    assert sorted(alloc.allocate(6)) == list(range(6))


def test_take_removes_a_specific_free_block():
    alloc = BlockAllocator(5)
    alloc.take(3, owner=8)
    assert alloc.ref_count(3) == 1 and alloc.owners(3) == {8}
    assert alloc.num_free() == 4
    with pytest.raises(ValueError, match=r"block 3 is not free \(ref count 1\)"):
        alloc.take(3)
    # the rest keep their order; 3 is never handed out again while taken
    assert alloc.allocate(4) == [0, 1, 2, 4]


def test_allocated_blocks_tracks_changes():
    alloc = BlockAllocator(8)
    ids = alloc.allocate(5)
    assert alloc.allocated_blocks() == sorted(ids)
    alloc.free(ids[:2])
    assert alloc.allocated_blocks() == sorted(ids[2:])
