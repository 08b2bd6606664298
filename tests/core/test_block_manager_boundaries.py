"""BlockManager: block boundaries, exhaustion without partial state, clear errors."""

from __future__ import annotations

import itertools

import pytest

from paged_core import BlockManager, OutOfBlocksError, UnknownSequenceError

_ids = itertools.count(1000)


def fresh(n: int) -> list[int]:
    """``n`` token ids no other prompt of the run holds (no prefix hit on them)."""
    return [next(_ids) for _ in range(n)]


@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize(
    ("prompt", "blocks_before", "blocks_after"),
    [("bs-1", 1, 1), ("bs", 1, 2), ("2bs", 2, 3)],
)
def test_prompt_then_one_append_at_block_boundaries(bs, prompt, blocks_before, blocks_after):
    n = {"bs-1": bs - 1, "bs": bs, "2bs": 2 * bs}[prompt]
    m = BlockManager(num_blocks=8, block_size=bs)
    assert m.num_blocks_needed(fresh(n)) == blocks_before
    assert m.allocate(1, list(range(n))) == 0
    assert len(m.block_table(1)) == blocks_before
    assert m.num_free_blocks() == 8 - blocks_before
    assert m.can_append([1])
    assert m.append(1, 7) == ()
    assert len(m.block_table(1)) == blocks_after
    assert m.num_tokens(1) == n + 1
    assert m.num_free_blocks() == 8 - blocks_after
    assert m.audit() == []
    m.free(1)
    assert m.num_free_blocks() == 8 and m.audit() == []


def test_block_size_one_takes_a_block_per_token():
    m = BlockManager(num_blocks=6, block_size=1)
    m.allocate(1, [5, 6, 7])
    assert m.block_table(1) == [0, 1, 2]
    for t in (8, 9):
        m.append(1, t)
    assert m.block_table(1) == [0, 1, 2, 3, 4]
    m.mark_computed(1, 5)
    # every prompt token but the last can hit
    assert m.allocate(2, [5, 6, 7, 8]) == 3
    assert m.block_table(2) == [0, 1, 2, 5]
    assert not m.can_append([1]) and not m.can_append([2])
    assert m.audit() == []


def test_fresh_manager_hands_out_blocks_in_ascending_order():
    m = BlockManager(num_blocks=5, block_size=2)
    m.allocate(1, fresh(5))
    assert m.block_table(1) == [0, 1, 2]


def test_exhausted_allocate_leaves_no_partial_state():
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate(1, fresh(9))  # 3 blocks
    before = m.stats()
    assert not m.can_allocate(fresh(8))
    with pytest.raises(
        OutOfBlocksError,
        match=r"sequence 2 needs 2 free blocks for 8 tokens .* only 1 of 4 are free",
    ):
        m.allocate(2, fresh(8))
    assert 2 not in m.seq_ids()
    assert m.num_free_blocks() == 1
    assert m.stats() == before
    assert m.audit() == []
    # the id is still usable once it fits
    assert m.can_allocate(fresh(4))
    m.allocate(2, fresh(4))
    assert m.num_free_blocks() == 0


def test_exhausted_allocate_with_prefix_hits_keeps_cached_blocks_free():
    m = BlockManager(num_blocks=4, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    m.allocate(1, prompt)
    m.mark_computed(1, 5)
    m.free(1)
    m.allocate(2, [9, 9])  # free now: the two cached blocks of seq 1 and one plain block
    cached_before = m.stats().blocks_cached_free
    # 2 hit blocks (both free and cached) + 3 fresh = 5 free blocks needed, 3 free
    long_prompt = prompt[:4] + [7, 7, 7, 7, 7]
    assert m.num_blocks_needed(long_prompt) == 5
    with pytest.raises(OutOfBlocksError):
        m.allocate(3, long_prompt)
    assert m.stats().blocks_cached_free == cached_before == 2
    assert m.stats().prefix_hits_tokens == 0
    assert m.audit() == []
    # a prompt that fits still hits both cached blocks
    assert m.allocate(3, prompt[:4] + [8]) == 4


def test_exhausted_append_leaves_no_partial_state():
    m = BlockManager(num_blocks=2, block_size=2)
    m.allocate(1, fresh(4))
    assert not m.can_append([1])
    with pytest.raises(OutOfBlocksError, match="sequence 1 needs a new block for token 4"):
        m.append(1, 3)
    assert m.num_tokens(1) == 4 and m.block_table(1) == [0, 1]
    assert m.audit() == []


def test_can_append_counts_more_than_one_token():
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate(1, fresh(3))
    assert m.can_append([1], num_tokens=1 + 4 * 3)  # fills 4 blocks
    assert not m.can_append([1], num_tokens=2 + 4 * 3)
    assert m.can_append([1], num_tokens=0)


def test_capacity_queries():
    m = BlockManager(num_blocks=10, block_size=8)
    assert m.free_token_capacity() == 80
    m.allocate(3, fresh(17))
    assert m.num_free_blocks() == 7 and m.free_token_capacity() == 56
    assert m.num_tokens(3) == 17 and m.seq_ids() == [3]
    m.allocate(1, fresh(1))
    assert m.seq_ids() == [3, 1]


def test_empty_prompt_is_a_value_error():
    m = BlockManager(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="at least 1 token"):
        m.allocate(1, [])
    with pytest.raises(ValueError):
        m.can_allocate([])
    assert m.seq_ids() == [] and m.audit() == []


def test_allocating_an_existing_sequence_is_a_value_error():
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate(1, fresh(3))
    with pytest.raises(ValueError, match="sequence 1 already has blocks"):
        m.allocate(1, fresh(3))
    assert m.num_free_blocks() == 3


def test_unknown_sequence_errors_name_the_id():
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate(1, fresh(3))
    m.free(1)
    for call in (
        m.free,
        m.block_table,
        m.num_tokens,
        lambda s: m.append(s, 1),
        lambda s: m.mark_computed(s, 0),
        lambda s: m.fork(s, 9),
        lambda s: m.can_append([s]),
    ):
        with pytest.raises(
            UnknownSequenceError,
            match="unknown sequence 1: it was never allocated or is already freed",
        ):
            call(1)
    # usable as either kind of lookup failure
    assert issubclass(UnknownSequenceError, ValueError) and issubclass(
        UnknownSequenceError, KeyError
    )


def test_mark_computed_beyond_length_is_a_value_error():
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate(1, fresh(3))
    with pytest.raises(ValueError, match="sequence 1 has 3 tokens; cannot mark 4 as computed"):
        m.mark_computed(1, 4)


@pytest.mark.parametrize(("blocks", "bs"), [(-1, 4), (4, 0)])
def test_bad_construction(blocks, bs):
    with pytest.raises(ValueError, match="must be >= "):
        BlockManager(blocks, bs)


def test_empty_pool_admits_nothing():
    m = BlockManager(num_blocks=0, block_size=4)
    assert not m.can_allocate(fresh(1))
    with pytest.raises(OutOfBlocksError):
        m.allocate(1, fresh(1))
    assert m.stats().usage == 0.0 and m.audit() == []
