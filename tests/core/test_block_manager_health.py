"""Counters, preemption, audits that catch corruption, and leak reclaim."""

from __future__ import annotations

import itertools
from dataclasses import fields

from paged_core import Block, BlockManager, BlockManagerStats

_ids = itertools.count(1000)


def fresh(n: int) -> list[int]:
    """``n`` token ids no other prompt of the run holds (no prefix hit on them)."""
    return [next(_ids) for _ in range(n)]


def test_stats_track_usage_and_tokens():
    m = BlockManager(num_blocks=10, block_size=4)
    m.allocate(1, fresh(6))
    m.allocate(2, fresh(9))
    m.append(2, -1)
    st = m.stats()
    assert (st.num_blocks, st.block_size) == (10, 4)
    assert (st.blocks_used, st.blocks_free) == (5, 5)
    assert st.tokens_used == 16
    assert m.free_token_capacity() == 20
    assert st.usage == 0.5
    m.fork(1, 3)
    assert m.stats().tokens_used == 22 and m.stats().blocks_used == 5  # shared blocks count once
    m.free(2)
    assert m.stats().tokens_used == 12


def test_stats_as_dict_has_every_counter():
    d = BlockManager(num_blocks=3).stats().as_dict()
    assert list(d) == [f.name for f in fields(BlockManagerStats)]
    assert all(isinstance(v, int | float) for v in d.values())


def test_free_after_append_releases_every_block():
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate(1, fresh(5))
    m.append(1, -1)
    assert m.num_tokens(1) == 6
    m.free(1)
    assert m.seq_ids() == []
    assert m.num_free_blocks() == 4
    assert m.audit() == []


def test_audit_reports_a_miscounted_reference():
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate(1, fresh(5))
    block = m.block_table(1)[0]
    m.block_pool.acquire(m.block_pool.blocks[block])  # a reference no page table accounts for
    problems = m.audit()
    assert any(
        f"block {block} (miscounted) has ref count 2 but 1 page tables hold it" in p
        for p in problems
    )


def test_audit_reports_a_block_taken_behind_the_managers_back():
    """Holders come from the page tables: a block in use that none holds is a leak."""
    m = BlockManager(num_blocks=4, block_size=4)
    m.block_pool.acquire(m.block_pool.blocks[3])  # out of the free queue, in no page table
    assert any("block 3 (leaked) has ref count 1 but 0 page tables" in p for p in m.audit())


def test_audit_reports_a_referenced_block_on_the_free_list():
    """It would be handed out again while a sequence still uses it."""
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate(1, fresh(5))
    block = m.block_table(1)[0]
    # deliberate corruption, as a release that dropped a reference too many would leave it
    m.block_pool.free_queue[m.block_pool.blocks[block]] = None
    assert f"block {block} has ref count 1 but is on the free list" in " | ".join(m.audit())


def test_audit_reports_an_unreferenced_block_on_no_free_list():
    """Lost: no sequence holds it and it can never be handed out again."""
    m = BlockManager(num_blocks=4, block_size=4)
    del m.block_pool.free_queue[m.block_pool.blocks[3]]  # deliberate corruption
    assert "block 3 has ref count 0 but is on no free list" in " | ".join(m.audit())


def test_audit_reports_unknown_ids_on_the_free_list():
    m = BlockManager(num_blocks=4, block_size=4)
    m.block_pool.free_queue[Block(9)] = None  # deliberate corruption
    m.block_pool.free_queue[Block(-1)] = None
    problems = " | ".join(m.audit())
    assert "free list holds unknown block id 9" in problems
    assert "free list holds unknown block id -1" in problems


def test_audit_reports_a_cached_block_that_holds_another_prefix():
    """A hit on it would serve KV of other tokens."""
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate(1, [1, 2, 3, 4, 5, 6])
    m.mark_computed(1, 6)
    block = m.block_pool.blocks[m.block_table(1)[0]]
    assert block.block_hash is not None and m.audit() == []
    block.token_ids = (9, 9, 9, 9)  # deliberate corruption
    assert f"sequence 1: block {block.block_id} caches another prefix" in m.audit()


def test_audit_is_clean_with_cached_and_plain_free_blocks():
    m = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    m.allocate(1, list(range(9)))
    m.mark_computed(1, 9)
    m.allocate(2, fresh(5))
    m.free(1)  # two full blocks stay cached on the free queue, one holds no cached KV
    assert m.block_pool.num_cached_free > 0
    assert m.audit() == []


def test_reclaim_leaked_frees_unreferenced_blocks():
    m = BlockManager(num_blocks=6, block_size=4)
    m.allocate(1, fresh(5))
    # a bug elsewhere took blocks from the pool and forgot them
    leaked = [b.block_id for b in m.block_pool.get_new_blocks(2)]
    assert m.audit() != []
    assert m.reclaim_leaked() == sorted(leaked)
    assert m.audit() == []
    assert m.num_free_blocks() == 4
    assert m.reclaim_leaked() == []
    m.free(1)
    assert m.num_free_blocks() == 6 and m.audit() == []
