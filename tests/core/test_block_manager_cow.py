"""Copy-on-write forks: shared blocks, private copies on the first write, clean release."""

from __future__ import annotations

import itertools

import pytest

from paged_core import BlockManager

_ids = itertools.count(1000)


def fresh(n: int) -> list[int]:
    """``n`` token ids no other prompt of the run holds (no prefix hit on them)."""
    return [next(_ids) for _ in range(n)]

BS = 4


def test_append_to_childs_shared_partial_block_copies_it_once(fake_pool):
    pool = fake_pool(8, BS)
    pool.allocate(1, [1, 2, 3, 4, 5, 6])  # blocks: full + partial (2 of 4)
    pool.compute(1)
    parent_table = pool.m.block_table(1)
    pool.fork(1, 2)
    assert pool.m.block_table(2) == parent_table
    assert all(pool.m.block_pool.blocks[b].ref_count == 2 for b in parent_table)

    copies = pool.append(2, 70)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == parent_table[-1] and dst not in parent_table
    assert pool.m.block_table(1) == parent_table  # parent untouched
    assert pool.m.block_table(2) == [parent_table[0], dst]
    blocks = pool.m.block_pool.blocks
    assert blocks[src].ref_count == 1 and blocks[parent_table[0]].ref_count == 2

    # the parent's own next token lands in its now-private block: no copy
    assert pool.append(1, 60) == []
    pool.compute(1)
    pool.compute(2)
    pool.check_all()
    assert pool.m.stats().cow_copies == 1 and pool.m.stats().forks == 1

    pool.free(1)
    pool.free(2)
    assert pool.m.num_free_blocks() == 8
    assert pool.m.audit() == []


def test_fork_at_a_block_boundary_needs_no_copy(fake_pool):
    pool = fake_pool(8, BS)
    pool.allocate(1, list(range(8)))
    pool.compute(1)
    pool.fork(1, 2)
    assert pool.append(2, 8) == [] and pool.append(1, 9) == []
    assert pool.m.block_table(1)[:2] == pool.m.block_table(2)[:2]
    assert pool.m.block_table(1)[2] != pool.m.block_table(2)[2]
    assert pool.m.stats().cow_copies == 0


@pytest.mark.parametrize("free_order", [(1, 2, 3), (3, 2, 1), (2, 1, 3)])
def test_forks_of_forks(fake_pool, free_order):
    pool = fake_pool(12, BS)
    pool.allocate(1, [1, 2, 3, 4, 5])
    pool.compute(1)
    pool.fork(1, 2)
    pool.fork(2, 3)
    table = pool.m.block_table(1)
    assert pool.m.block_table(3) == table
    assert [pool.m.block_pool.blocks[b].ref_count for b in table] == [3, 3]
    assert all(table[1] in pool.m.block_table(s) for s in (1, 2, 3))

    copies = [pool.append(s, 10 * s) for s in (3, 2, 1)]
    # the first two writers get private copies; the last one keeps the original
    assert [len(c) for c in copies] == [1, 1, 0]
    assert pool.m.block_table(1) == table
    for s in (1, 2, 3):
        pool.compute(s)
    pool.check_all()
    for s in free_order:
        pool.free(s)
        assert pool.m.audit() == []
    assert pool.m.num_free_blocks() == 12


def test_can_append_counts_copies_exactly():
    m = BlockManager(num_blocks=4, block_size=BS)
    m.allocate(1, fresh(6))  # 2 blocks
    m.fork(1, 2)
    m.fork(1, 3)  # last block shared three ways, 2 blocks free
    assert m.can_append([1, 2, 3])  # 2 copies
    assert m.can_append([1, 2])  # 2 copies: neither writer is the last holder
    m.allocate(4, fresh(1))  # 1 block free now
    assert not m.can_append([1, 2, 3])
    assert not m.can_append([1, 2])
    assert m.can_append([3])
    assert m.append(3, -1) != ()  # takes the last free block for its copy
    assert not m.can_append([1, 2])
    m.free(4)  # 1 block free again
    assert m.can_append([1, 2])  # one copy, then the other owns the original
    m.append(1, -1)
    assert m.num_free_blocks() == 0
    assert m.append(2, -1) == ()
    assert m.audit() == []


def test_fork_into_existing_sequence_is_a_value_error():
    m = BlockManager(num_blocks=4, block_size=BS)
    m.allocate(1, fresh(3))
    m.allocate(2, fresh(3))
    with pytest.raises(ValueError, match="cannot fork into sequence 2: it already exists"):
        m.fork(1, 2)
    assert m.block_pool.blocks[m.block_table(1)[0]].ref_count == 1
    assert m.audit() == []


def test_fork_keeps_prefix_caching_going(fake_pool):
    pool = fake_pool(12, BS)
    pool.allocate(1, [1, 2, 3, 4, 5, 6])  # not computed yet
    pool.fork(1, 2)
    for t in (7, 8):
        pool.append(2, t)
    pool.compute(2)  # child computes the shared full block and its own second block
    pool.compute(1)
    assert pool.allocate(3, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8
    pool.compute(3)
    pool.check_all()
