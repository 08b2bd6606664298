"""``reserve``: the scheduler's one call per sequence per step, on both pools.

It must leave a pool exactly as the same tokens appended one at a time with
``append_token`` would: the same blocks, page-table mirror, copy-on-write
copies and prefix hashes; and stop, changing nothing more, where the pool
runs out.
"""

from __future__ import annotations

import torch

from paged_ref import ContiguousKVPool, PagedKVPool

BS = 4


def paged(num_blocks: int, prefix_caching: bool = True) -> PagedKVPool:
    return PagedKVPool.from_model_config(
        1, 1, 8, num_blocks, BS, torch.float32, enable_prefix_caching=prefix_caching
    )


def test_reserve_crosses_blocks_like_append_token():
    history = list(range(100, 113))  # 13 tokens: three block boundaries past the prompt
    by_reserve, by_append = paged(8), paged(8)
    a, _ = by_reserve.allocate_sequence(history[:3])
    b, _ = by_append.allocate_sequence(history[:3])
    assert by_reserve.reserve(a, history, 13) == 13
    for token in history[3:13]:
        by_append.append_token(b, token)
    assert by_reserve.block_table(a) == by_append.block_table(b)
    assert by_reserve.block_manager._seqs[a].tokens == history  # hashed later as computed
    assert by_reserve.audit() == [] and by_append.audit() == []  # mirror rows match


def test_reserve_is_a_no_op_below_what_is_reserved():
    pool = paged(4)
    seq_id, _ = pool.allocate_sequence([1, 2, 3, 4, 5])
    free = pool.free_seq_count()
    assert pool.reserve(seq_id, [1, 2, 3, 4, 5], 3) == 5
    assert pool.free_seq_count() == free


def test_reserve_stops_where_blocks_run_out_and_changes_nothing_more():
    pool = paged(2)
    history = list(range(12))
    seq_id, _ = pool.allocate_sequence(history[:3])
    assert pool.reserve(seq_id, history, 12) == 8  # two blocks of four
    assert pool.get_num_reserved(seq_id) == 8 and pool.free_seq_count() == 0
    assert pool.audit() == []
    pool.free_seq(seq_id)  # every block it took comes back
    assert pool.free_seq_count() == 2


def test_reserve_copies_a_shared_last_block_on_write():
    pool = paged(6)
    parent, _ = pool.allocate_sequence([1, 2, 3, 4, 5, 6])
    child = pool.fork_seq(parent)
    shared_last = pool.block_table(parent)[-1]
    assert pool.reserve(child, [1, 2, 3, 4, 5, 6, 9], 7) == 7
    assert pool.block_table(child)[-1] != shared_last  # a private copy
    assert pool.block_table(parent)[-1] == shared_last
    assert pool.manager._pending_copies == [(shared_last, pool.block_table(child)[-1])]
    assert pool.audit() == []


def test_contiguous_reserve_stops_at_max_model_len():
    pool = ContiguousKVPool.from_model_config(1, 1, 8, 8, 2, dtype=torch.float32)
    seq_id, _ = pool.allocate_sequence([1, 2, 3])
    assert pool.reserve(seq_id, list(range(20)), 6) == 6
    assert pool.reserve(seq_id, list(range(20)), 20) == 8  # the row's end
    assert pool.reserve(seq_id, list(range(20)), 4) == 8
    assert pool.get_num_reserved(seq_id) == 8 and pool.audit() == []
