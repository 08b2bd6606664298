"""The block manager with KV cache groups (hybrid models): sliding groups give
blocks back, prefix hits need the window's blocks, and the audit stays clean
in every group."""

from __future__ import annotations

import math

import pytest

from paged_core import BlockManager, OutOfBlocksError, kv_cache_groups

W, BS = 8, 4
# A tiny Gemma 3: 5 local layers per global one -> 6 groups of one layer.
LAYERS = [W, W, W, W, W, None]


def manager(
    num_blocks: int = 200, layers: list[int | None] = LAYERS, **kw: bool
) -> BlockManager:
    groups = kv_cache_groups(layers, hybrid=kw.pop("hybrid", True))
    return BlockManager(num_blocks, BS, sliding_windows=[g.sliding_window for g in groups], **kw)


def grow(c: BlockManager, seq_id: int, tokens: list[int], upto: int) -> None:
    """Decode: append and commit one token at a time until ``upto`` tokens;
    between the two, no sliding group holds more than ceil(W / bs) + 1 blocks."""
    while c.num_tokens(seq_id) < upto:
        c.append(seq_id, tokens[c.num_tokens(seq_id)])
        for g in range(1, c.num_groups):
            live = c.block_table(seq_id, g)[c.num_released(seq_id, g) :]
            assert len(live) <= math.ceil(W / BS) + 1
        c.mark_computed(seq_id, c.num_tokens(seq_id))


def test_sliding_groups_hold_a_bounded_window_as_tokens_grow() -> None:
    tokens = list(range(100, 180))
    hybrid, one = manager(), manager(hybrid=False)
    held: dict[str, list[int]] = {"hybrid": [], "one": []}
    for name, c in (("hybrid", hybrid), ("one", one)):
        c.allocate(0, tokens[:20])
        c.mark_computed(0, 20)
        for length in (20, 40, 60, 79):
            grow(c, 0, tokens, length)
            held[name].append(c.num_blocks - c.num_free_blocks())
            if name == "hybrid":
                global_blocks, *local = c.group_blocks_used()
                assert global_blocks == math.ceil(length / BS)
                assert all(n <= math.ceil(W / BS) + 1 for n in local), local
            assert c.audit() == []
    # One group: every layer keeps every block (the 5 -> 10 -> 15 -> 20).
    assert held["one"] == [5, 10, 15, 20]
    # Hybrid, in layer-blocks (one layer per group here): global L/bs + 5 x
    # W/bs once committed (one more while a token is reserved, not yet written)
    # against 6 layers x L/bs for one group: 30 vs 120 at 79 tokens.
    assert held["hybrid"] == [5 + 5 * 2, 10 + 5 * 2, 15 + 5 * 2, 20 + 5 * 2]
    assert 6 * held["one"][-1] == 120


def test_one_group_has_no_null_block() -> None:
    c = manager(10, [None, None])
    assert c.num_groups == 1 and c.null_block_id is None and c.num_blocks == 10
    c.allocate(0, list(range(9)))
    assert c.block_table(0) == [0, 1, 2]
    # A pool with a sliding group reserves its last block as the null block.
    assert manager(10).num_blocks == 9 and manager(10).null_block_id == 9


def test_prefix_hit_needs_the_sliding_groups_window() -> None:
    c = manager(60)
    prompt = list(range(24))  # 6 blocks
    c.allocate(0, prompt)
    c.mark_computed(0, 24)  # sliding groups release blocks 0..3 (cached, free)
    assert c.num_released(0, group=1) == 4
    # Same 6 blocks + more: up to 5 blocks can hit; the window of a 5-block hit
    # (positions 13..19) lies in blocks 3..4, cached in every group.
    assert c.allocate(1, prompt) == 20
    assert c.block_table(1, group=1)[:3] == [c.null_block_id] * 3
    assert c.audit() == []
    # Evict every free cached block (the released early blocks go first).
    c.free(1)
    hog = c.num_free_blocks() // c.num_groups * BS
    c.allocate(2, [7] * hog)
    c.free(2)
    # The same prompt now misses: a 5-block hit needs sliding block 3, evicted.
    assert not c.can_allocate(prompt) or c.num_blocks_needed(prompt) == 6 * 6
    # A longer prompt's 6-block hit needs only blocks 4..5 (positions 17..23)
    # in the sliding groups, still held by sequence 0: it hits although
    # blocks 0..3 of every sliding group are gone.
    assert c.allocate(3, prompt + [1, 2, 3, 4]) == 24
    assert c.block_table(3, group=1)[:4] == [c.null_block_id] * 4
    # A prompt that diverges at block 2 would need sliding blocks 0..1 for its
    # hit, which were released and evicted: no hit although the global group has them.
    assert c.allocate(4, prompt[:8] + [999] * 4) == 0
    stats = c.stats()
    assert stats.prefix_hits_tokens == 20 + 24  # counted once per prompt, not per group
    assert stats.prefix_queries_tokens == 24 + 24 + hog + 28 + 12
    assert c.audit() == []


def test_prefix_hit_after_the_sequence_left_keeps_cached_windows() -> None:
    c = manager(80)
    prompt = list(range(40))
    c.allocate(0, prompt)
    c.mark_computed(0, 40)
    c.free(0)
    # Global: 9 hits on free blocks + 1 new; sliding: only the window's 2 + 1 new.
    assert c.num_blocks_needed(prompt) == 10 + 5 * 3
    assert c.allocate(1, prompt) == 36
    # Sliding groups took only the window's blocks back: 2 (of 9 hit) + 1 new.
    assert c.group_blocks_used()[1:] == [3] * 5 and c.group_blocks_used()[0] == 10
    assert c.audit() == []


def assert_group_usage_counted(c: BlockManager) -> None:
    """The pool's per-group count equals the distinct blocks each group's tables hold."""
    held = [
        len({b for s in c.seq_ids() for b in c.block_table(s, g)[c.num_released(s, g) :]})
        for g in range(c.num_groups)
    ]
    assert c.group_blocks_used() == held


def test_audit_clean_through_fork_cow_free_and_preempt_in_every_group() -> None:
    c = manager(120)
    prompt = list(range(50, 63))  # 13 tokens: a shared partial last block
    c.allocate(0, prompt)
    c.mark_computed(0, 13)
    c.fork(0, 1)
    assert c.audit() == []
    copies = [(src, dst) for _, src, dst in c.append(1, 7)]  # CoW in all 6 groups
    assert len(copies) == 6 and len({dst for _, dst in copies}) == 6
    c.mark_computed(1, 14)
    grow(c, 0, prompt + list(range(40)), 30)
    grow(c, 1, prompt + [7] + list(range(40)), 30)
    assert c.audit() == []
    assert_group_usage_counted(c)
    c.fork(1, 2)  # a fork of a sequence with released (null) entries
    grow(c, 2, prompt + [7] + list(range(60)), 40)
    assert c.audit() == []
    assert_group_usage_counted(c)
    c.free(1)  # a preemption is a free of every group
    assert c.audit() == []
    assert_group_usage_counted(c)
    for s in (0, 2):
        c.free(s)
    assert c.audit() == [] and c.num_free_blocks() == c.num_blocks
    assert c.group_blocks_used() == [0] * c.num_groups
    assert c.stats().cow_copies == 2 * 6 and c.stats().forks == 2  # both forks split a block


def test_exhaustion_is_all_or_nothing_over_groups() -> None:
    c = manager(13)  # 12 usable blocks: 2 per group
    assert not c.can_allocate(list(range(9)))  # 3 blocks x 6 groups
    with pytest.raises(OutOfBlocksError, match="6 KV cache groups"):
        c.allocate(0, list(range(9)))
    c.allocate(0, list(range(8)))
    assert c.num_free_blocks() == 0 and not c.can_append([0])
    with pytest.raises(OutOfBlocksError):
        c.append(0, 1)
    assert c.audit() == [] and c.num_tokens(0) == 8


def test_leaked_blocks_are_found_and_reclaimed_across_groups() -> None:
    c = manager(40)
    c.allocate(0, list(range(9)))
    leaked = c.block_pool.get_new_blocks(2)
    assert any("leaked" in p for p in c.audit())
    assert sorted(c.reclaim_leaked()) == sorted(b.block_id for b in leaked)
    assert c.audit() == []


def test_num_reserved_takes_the_prompt_now_and_the_rest_as_it_is_computed() -> None:
    """A preempted sequence comes back like this: its prompt in every group,
    then token by token, so its sliding groups never hold its whole history."""
    bm = BlockManager(41, 4, enable_prefix_caching=False, sliding_windows=[None, 8, 8, 8])
    history = list(range(3, 43))  # 40 tokens: 10 blocks
    assert bm.num_blocks_needed(history) == 4 * 10  # all of it in all four groups
    assert bm.num_blocks_needed(history, num_reserved=12) == 4 * 3  # the 12-token prompt
    assert bm.allocate(0, history, num_reserved=12) == 0
    assert bm.num_tokens(0) == 12
    bm.mark_computed(0, 12)
    peak = 0
    for n, token in enumerate(history[12:], 13):
        bm.append(0, token)
        bm.mark_computed(0, n)
        peak = max(peak, bm.num_blocks - bm.num_free_blocks())
        assert bm.audit() == []
    # The full group holds all 10 blocks, each sliding group its window's 2 (or 3 mid-block).
    assert bm.num_blocks - bm.num_free_blocks() == 10 + 3 * 2
    assert peak <= 10 + 3 * 3 < 4 * 10
