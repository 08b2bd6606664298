"""BlockPool: exhaustion, exact errors, reuse and eviction order, ref counts, double frees."""

from __future__ import annotations

import pytest

from paged_core import Block, BlockPool, OutOfBlocksError
from paged_core.block_pool import hash_block_tokens

BS = 2


def ids(blocks: list[Block]) -> list[int]:
    return [b.block_id for b in blocks]


def cache(pool: BlockPool, block: Block, tag: int) -> None:
    """Register ``block`` (in use) as holding the tokens ``[tag, tag]``."""
    assert pool.register(block, hash_block_tokens(None, [tag, tag]), [tag, tag])


def test_take_to_exhaustion_then_out_of_blocks():
    pool = BlockPool(10)
    first = pool.get_new_blocks(5)
    assert len(pool.free_queue) == 5
    second = pool.get_new_blocks(5)
    assert len(pool.free_queue) == 0
    assert sorted(ids(first + second)) == list(range(10))
    assert all(b.ref_count == 1 for b in first + second)
    with pytest.raises(OutOfBlocksError, match=r"cannot allocate 1 blocks: only 0 of 10 are free"):
        pool.get_new_blocks(1)


def test_out_of_blocks_is_a_runtime_error_and_changes_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    assert issubclass(OutOfBlocksError, RuntimeError)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(2)
    # all or nothing: the one free block is still there
    assert len(pool.free_queue) == 1
    assert ids(pool.get_new_blocks(1)) == [3]


def test_fresh_pool_hands_out_ascending_ids_and_zero_is_nothing():
    pool = BlockPool(3)
    assert pool.get_new_blocks(0) == []
    assert len(pool.free_queue) == 3
    assert ids(pool.get_new_blocks(3)) == [0, 1, 2]


def test_blocks_without_cached_kv_are_reused_first_most_recent_first():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    pool.free(a)  # 0 then 1 go to the front of the queue
    assert ids(list(pool.free_queue)) == [1, 0, 2, 3]
    assert ids(pool.get_new_blocks(4)) == [1, 0, 2, 3]
    assert pool.evictions == 0


def test_cached_blocks_are_evicted_least_recently_freed_first_after_the_rest():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    for tag, b in enumerate(blocks[:3]):
        cache(pool, b, tag)
    pool.free([blocks[2], blocks[0], blocks[1], blocks[3]])
    # block 3 holds nothing worth keeping: front; cached ones behind it, in the order freed
    assert ids(list(pool.free_queue)) == [3, 2, 0, 1]
    assert pool.num_cached_free == 3
    assert ids(pool.get_new_blocks(3)) == [3, 2, 0]
    assert pool.evictions == 2 and pool.num_cached_free == 1
    assert blocks[2].block_hash is None and blocks[0].block_hash is None
    assert len(pool.prefix_index) == 1 and blocks[1].block_hash is not None


def test_a_hit_takes_a_cached_block_out_of_the_middle_of_the_free_queue():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(6)
    for tag, b in enumerate(blocks[:3]):
        cache(pool, b, tag)
    pool.free(blocks[3:])
    pool.free(blocks[:3])
    assert ids(list(pool.free_queue)) == [5, 4, 3, 0, 1, 2]
    hit = pool.lookup(hash_block_tokens(None, [1, 1]), [1, 1])
    assert hit is blocks[1]
    pool.acquire(hit)
    assert hit.ref_count == 1 and hit.block_hash is not None  # content kept, no eviction
    assert ids(list(pool.free_queue)) == [5, 4, 3, 0, 2]
    assert pool.num_cached_free == 2 and pool.evictions == 0
    # the rest keep their order; the hit is never handed out while in use
    assert ids(pool.get_new_blocks(5)) == [5, 4, 3, 0, 2]


def test_acquire_three_times_then_free_three_times():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.acquire(b)
    pool.acquire(b)
    assert b.ref_count == 3
    pool.free([b])
    assert b.ref_count == 2 and b not in pool.free_queue
    pool.free([b])
    pool.free([b])
    assert b.ref_count == 0 and b in pool.free_queue
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])


def test_double_free_is_a_value_error_and_changes_nothing():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    pool.free(blocks)
    with pytest.raises(ValueError, match=r"double free of block 0: it is already free"):
        pool.free(blocks)
    assert len(pool.free_queue) == 5


def test_double_free_within_one_call_is_caught_before_any_change():
    pool = BlockPool(5)
    a, b = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match=r"double free of block 0: freed 2 times in one call"):
        pool.free([b, a, a])
    # b was not released either: the call changed nothing
    assert a.ref_count == 1 and b.ref_count == 1
    assert len(pool.free_queue) == 3


def test_free_of_a_never_taken_block_is_a_double_free():
    pool = BlockPool(5)
    pool.get_new_blocks(1)
    with pytest.raises(ValueError, match=r"double free of block 3: it is already free"):
        pool.free([pool.blocks[3]])


@pytest.mark.parametrize("bad", [-1, 2, 5, 100])
def test_a_block_of_another_pool_is_a_value_error(bad):
    pool = BlockPool(5)
    pool.get_new_blocks(5)
    stranger = Block(bad, ref_count=1)  # same id as one of ours, or none of ours
    for call in (lambda: pool.free([stranger]), lambda: pool.reclaim(stranger)):
        with pytest.raises(ValueError, match=rf"unknown block {bad}: not a block of this pool"):
            call()
    assert len(pool.free_queue) == 0


def test_bad_size_and_empty_pool():
    with pytest.raises(ValueError, match="num_blocks must be >= 0"):
        BlockPool(-1)
    pool = BlockPool(0)
    assert len(pool.free_queue) == 0 and pool.get_new_blocks(0) == []
    with pytest.raises(OutOfBlocksError, match="only 0 of 0 are free"):
        pool.get_new_blocks(1)
    assert pool.audit([], BS) == []


def test_register_first_wins_and_lookup_compares_tokens():
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    key = hash_block_tokens(None, [7, 8])
    assert pool.register(a, key, [7, 8])
    assert not pool.register(b, key, [7, 8])  # same content elsewhere: a stays the one
    assert not pool.register(a, hash_block_tokens(None, [9, 9]), [9, 9])  # one key per block
    assert b.block_hash is None and pool.lookup(key, [7, 8]) is a
    # a colliding key with other tokens never serves a's KV
    assert pool.lookup(key, [7, 9]) is None
    assert pool.lookup(hash_block_tokens(None, [1, 2]), [1, 2]) is None
    assert pool.audit([[a], [b], [c]], BS) == []


def test_reclaim_frees_whatever_the_ref_count_and_drops_content():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    cache(pool, a, 1)
    pool.acquire(a)
    pool.reclaim(a)
    pool.reclaim(b)
    assert a.ref_count == 0 and a.block_hash is None and not pool.prefix_index
    assert len(pool.free_queue) == 4 and pool.num_cached_free == 0
    pool.reclaim(a)  # already free: no error, no change
    assert len(pool.free_queue) == 4 and pool.audit([], BS) == []


def test_audit_checks_holders_free_queue_and_index():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    cache(pool, a, 1)
    assert pool.audit([[a, b]], BS) == []
    problems = " | ".join(pool.audit([[a]], BS))
    assert "block 1 (leaked) has ref count 1 but 0 page tables hold it" in problems
    problems = " | ".join(pool.audit([[a, b], [a]], BS))
    assert "block 0 (miscounted) has ref count 1 but 2 page tables hold it" in problems
    pool.prefix_index[(0, hash_block_tokens(None, [5, 5]))] = b  # deliberate corruption
    problems = " | ".join(pool.audit([[a, b]], BS))
    assert "prefix index maps a key to block 1" in problems


def test_evicted_keys_forget_the_least_recently_evicted_first():
    """The bounded memory of evicted keys (it tells an "evicted" prefix miss
    from a "never seen" one) drops its oldest key when full, a key evicted
    again counting as the newest."""
    pool = BlockPool(1)

    def evict(tag: int) -> None:
        (b,) = pool.get_new_blocks(1)
        cache(pool, b, tag)
        pool.free([b])
        pool.free(pool.get_new_blocks(1))  # taking it back evicts the key

    def remembered(tag: int) -> bool:
        return (0, hash_block_tokens(None, [tag, tag])) in pool.evicted_keys

    for tag in range(pool.evicted_keys_limit):
        evict(tag)
    evict(0)  # full; evicted again, 0 is now the newest
    evict(-1)  # one over the limit: the oldest, 1, goes
    assert remembered(0) and remembered(-1) and not remembered(1)
    assert len(pool.evicted_keys) == pool.evicted_keys_limit
