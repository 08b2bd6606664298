"""Prefix caching: chained block keys, hits only on computed KV, LRU eviction of cached free blocks."""

from __future__ import annotations

import os
import subprocess
import sys

from paged_core import BlockManager
from paged_core.block_pool import hash_block_tokens

BS = 4
PREFIX = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34]  # exactly 3 blocks


def shared_blocks(m: BlockManager, a: int, b: int) -> int:
    ta, tb = m.block_table(a), m.block_table(b)
    assert len(set(ta) & set(tb)) == sum(x == y for x, y in zip(ta, tb, strict=False))
    return len(set(ta) & set(tb))


def test_shared_three_block_prefix_shares_exactly_three_blocks(fake_pool):
    pool = fake_pool(16, BS)
    assert pool.allocate(1, PREFIX + [1, 2, 3]) == 0
    pool.compute(1)
    assert pool.allocate(2, PREFIX + [7, 8]) == 12
    assert shared_blocks(pool.m, 1, 2) == 3
    assert [pool.m.block_pool.blocks[b].ref_count for b in pool.m.block_table(2)] == [2, 2, 2, 1]
    pool.compute(2)
    pool.check_all()


def test_different_token_in_block_2_shares_exactly_two(fake_pool):
    pool = fake_pool(16, BS)
    pool.allocate(1, PREFIX + [1])
    pool.compute(1)
    other = list(PREFIX)
    other[9] = 99  # inside block 2 (tokens 8..11)
    assert pool.allocate(2, other + [1]) == 8
    assert shared_blocks(pool.m, 1, 2) == 2
    pool.compute(2)
    pool.check_all()


def test_prefix_shorter_than_one_block_shares_nothing(fake_pool):
    pool = fake_pool(16, BS)
    pool.allocate(1, [1, 2, 3, 4, 5, 6])
    pool.compute(1)
    assert pool.allocate(2, [1, 2, 3, 9, 5, 6]) == 0
    assert shared_blocks(pool.m, 1, 2) == 0


def test_key_of_a_block_depends_on_every_earlier_token(fake_pool):
    pool = fake_pool(16, BS)
    pool.allocate(1, PREFIX + [1])
    pool.compute(1)
    # blocks 1 and 2 hold the same tokens, but token 0 differs: nothing may hit
    other = [10] + PREFIX[1:] + [1]
    assert pool.allocate(2, other) == 0
    assert shared_blocks(pool.m, 1, 2) == 0
    same_block_other_parent = hash_block_tokens(
        hash_block_tokens(None, [10, 12, 13, 14]), PREFIX[4:8]
    )
    assert same_block_other_parent != hash_block_tokens(
        hash_block_tokens(None, PREFIX[:4]), PREFIX[4:8]
    )


def test_block_keys_are_stable_across_processes():
    code = (
        "from paged_core.block_pool import hash_block_tokens as h;"
        "print(h(h(None, [1, 2, 3, 4]), [5, 6, 7, 8]).hex())"
    )
    keys = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},  # same import path, other seeds
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(keys) == 1
    assert (
        keys.pop().strip()
        == hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), [5, 6, 7, 8]).hex()
    )


def test_the_last_prompt_token_is_never_a_hit(fake_pool):
    pool = fake_pool(16, BS)
    pool.allocate(1, PREFIX)
    pool.compute(1)
    # same 12-token prompt: its third block holds the last token, so only 2 blocks hit
    assert pool.allocate(2, PREFIX) == 8
    assert pool.allocate(3, PREFIX + [5]) == 12


def test_no_hit_on_blocks_not_yet_computed(fake_pool):
    pool = fake_pool(16, BS)
    pool.allocate(1, PREFIX + [1])
    assert pool.allocate(2, PREFIX + [2]) == 0
    pool.compute(1, upto=6)  # only block 0 is full and computed
    assert pool.allocate(3, PREFIX + [3]) == 4
    pool.compute(1)
    assert pool.allocate(4, PREFIX + [4]) == 12
    for s in (2, 3, 4):
        pool.compute(s)
    pool.check_all()


def test_hits_after_the_first_owner_finished_reuse_its_blocks(fake_pool):
    pool = fake_pool(16, BS)
    pool.allocate(1, PREFIX + [1, 2])
    pool.compute(1)
    first = pool.m.block_table(1)
    pool.free(1)
    stats = pool.m.stats()
    assert stats.blocks_free == 16 and stats.blocks_cached_free == 3
    assert pool.allocate(2, PREFIX + [5, 6, 7]) == 12
    assert pool.m.block_table(2)[:3] == first[:3]
    assert pool.m.stats().blocks_cached_free == 0
    pool.compute(2)
    pool.check_all()


def test_blocks_filled_by_appends_are_cached_too(fake_pool):
    pool = fake_pool(16, BS)
    pool.allocate(1, [1, 2, 3, 4, 5, 6])
    for t in (7, 8, 9):
        pool.append(1, t)
    pool.compute(1)
    assert pool.allocate(2, [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    pool.compute(2)
    pool.check_all()


def test_same_content_computed_twice_keeps_one_cached_copy(fake_pool):
    pool = fake_pool(16, BS)
    pool.allocate(1, PREFIX + [1])
    pool.allocate(2, PREFIX + [2])  # both before either is computed: no hits
    pool.compute(1)
    pool.compute(2)
    pool.free(1)
    pool.free(2)
    assert pool.m.stats().blocks_cached_free == 3
    assert pool.allocate(3, PREFIX + [3]) == 12
    pool.check_all()


def test_eviction_is_least_recently_used_and_tail_first(fake_pool):
    pool = fake_pool(8, BS)
    a = [1] * 4 + [2] * 4 + [3] * 4 + [4]
    b = [5] * 4 + [6] * 4 + [7] * 4 + [8]
    pool.allocate(1, a)
    pool.compute(1)
    a_blocks = pool.m.block_table(1)
    pool.free(1)
    pool.allocate(2, b)
    pool.compute(2)
    pool.free(2)
    assert pool.m.stats().blocks_cached_free == 6  # 2 plain free blocks left
    # 4 fresh blocks: both plain ones first, then a's tail blocks (a is older than b)
    pool.allocate(3, [9] * 16)
    assert set(pool.m.block_table(3)) >= {a_blocks[2], a_blocks[1]}
    assert pool.m.stats().evictions == 2
    pool.free(3)
    assert pool.allocate(4, b) == 12
    assert pool.allocate(5, a) == 4
    for s in (4, 5):
        pool.compute(s)
    pool.check_all()


def test_a_hit_refreshes_recency(fake_pool):
    pool = fake_pool(8, BS)
    a = [1] * 4 + [2] * 4 + [3] * 4 + [4]
    b = [5] * 4 + [6] * 4 + [7] * 4 + [8]
    for seq, tokens in ((1, a), (2, b)):
        pool.allocate(seq, tokens)
        pool.compute(seq)
        pool.free(seq)
    pool.allocate(3, a)  # a is used again, so b becomes the older one
    pool.compute(3)
    pool.free(3)
    pool.allocate(4, [9] * 16)
    pool.free(4)
    assert pool.allocate(5, a) == 12
    assert pool.allocate(6, b) == 4


def test_hit_rate_counters(fake_pool):
    pool = fake_pool(16, BS)
    pool.allocate(1, PREFIX + [1])
    pool.compute(1)
    pool.allocate(2, PREFIX + [2, 3, 4])
    st = pool.m.stats()
    assert (st.prefix_queries_tokens, st.prefix_hits_tokens) == (13 + 15, 12)
    assert st.hit_rate == 12 / 28


def test_caching_can_be_switched_off(fake_pool):
    pool = fake_pool(16, BS, enable_prefix_caching=False)
    pool.allocate(1, PREFIX + [1])
    pool.compute(1)
    assert pool.allocate(2, PREFIX + [1]) == 0
    assert shared_blocks(pool.m, 1, 2) == 0
    pool.free(1)
    st = pool.m.stats()
    assert st.blocks_cached_free == 0 and st.prefix_queries_tokens == 0 and st.hit_rate == 0.0
    pool.check_all()
