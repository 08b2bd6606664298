"""Random interleavings of allocate / compute / append / fork / free / preempt with prefix hits.

Prompts are cut from a few shared documents (sometimes with one changed
token), so hits, partial hits, evictions and copy-on-write all happen. After
every operation: ``audit()`` is empty, every sequence reads back its own
tokens from the fake KV, and ``can_allocate`` / ``can_append`` agreed with
what the operation then did. At the end, freeing everything frees every block.
The hybrid variant runs the same operations with KV cache groups (a full one
beside sliding windows smaller and larger than a block), where sliding groups
release blocks and prefix hits need each window's blocks.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_core import OutOfBlocksError

MIN_OPS = 25
EXAMPLES = 200  # >= 200 * 25 = 5,000 operations per run
DOCS = [
    [1, 2, 3, 4, 5, 6, 7, 8] * 4,
    [i % 7 for i in range(32)],
    [1, 2, 3, 4, 9, 9, 9, 9] * 4,  # shares the first 4 tokens with doc 0
]

config = st.tuples(st.integers(4, 24), st.sampled_from([1, 2, 4]), st.booleans() | st.just(True))
op = st.one_of(
    st.tuples(
        st.just("allocate"),
        st.integers(0, 2),
        st.integers(1, 20),
        st.integers(-8, 19),
    ),
    st.tuples(st.just("compute"), st.integers(0, 50), st.integers(0, 4)),
    st.tuples(st.just("append"), st.integers(0, 50), st.integers(0, 3)),
    st.tuples(st.just("fork"), st.integers(0, 50)),
    st.tuples(st.just("free"), st.integers(0, 50)),
    st.tuples(st.just("preempt"), st.integers(0, 50)),
    st.tuples(st.just("can_append_all"), st.integers(1, 2)),
    st.tuples(st.just("reclaim")),
)


def do_allocate(pool, seq_id, doc, length, mutate_at):
    tokens = DOCS[doc][:length]
    if 0 <= mutate_at < length:
        tokens[mutate_at] = 100 + mutate_at
    free_before = pool.m.num_free_blocks()
    can = pool.m.can_allocate(tokens)
    needed = pool.m.num_blocks_needed(tokens)
    assert can == (needed <= free_before)
    if can:
        pool.allocate(seq_id, tokens)
        assert pool.m.num_free_blocks() == free_before - needed
    else:
        with pytest.raises(OutOfBlocksError):
            pool.allocate(seq_id, tokens)
        assert seq_id not in pool.m.seq_ids() and pool.m.num_free_blocks() == free_before


def do_append(pool, seq_id, token):
    before = pool.m.block_table(seq_id)
    if pool.m.can_append([seq_id]):
        pool.append(seq_id, token)
    else:
        with pytest.raises(OutOfBlocksError):
            pool.append(seq_id, token)
        assert pool.m.block_table(seq_id) == before


def check_can_append_all(pool, num_tokens):
    """``can_append(all, n)`` must say exactly whether growing every sequence by n fits."""
    live = pool.m.seq_ids()
    promised = pool.m.can_append(live, num_tokens)
    trial = copy.deepcopy(pool)
    try:
        for _ in range(num_tokens):
            for s in live:
                trial.append(s, 0)
        fits = True
    except OutOfBlocksError:
        fits = False
    assert promised == fits


@pytest.mark.parametrize(
    "windows", [(None,), (None, 3, 6)], ids=["one_group", "hybrid"]
)  # fmt: skip
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config, ops=st.lists(op, min_size=MIN_OPS, max_size=60))
def test_random_interleavings_keep_the_manager_consistent(fake_pool, windows, cfg, ops):
    num_blocks, block_size, caching = cfg
    pool = fake_pool(
        num_blocks * len(windows), block_size, enable_prefix_caching=caching,
        sliding_windows=windows,
    )  # fmt: skip
    num_blocks = pool.m.num_blocks  # a sliding group keeps one block as the null block
    next_id = 0
    for name, *args in ops:
        live = sorted(pool.tokens)
        if name == "allocate" or (not live and name != "reclaim"):
            doc, length, mutate_at = args if name == "allocate" else (0, 5, -1)
            do_allocate(pool, next_id, doc, length, mutate_at)
            next_id += 1
        elif name == "reclaim":
            assert pool.m.reclaim_leaked() == []
        elif name == "can_append_all":
            check_can_append_all(pool, args[0])
        else:
            seq_id = live[args[0] % len(live)]
            if name == "compute":
                done, total = pool.m.num_computed_tokens(seq_id), pool.m.num_tokens(seq_id)
                # mostly compute everything (a forward pass); sometimes only part (a chunk)
                pool.compute(seq_id, total if args[1] else (done + total) // 2)
            elif name == "append":
                do_append(pool, seq_id, *args[1:])
            elif name == "fork":
                pool.fork(seq_id, next_id)
                next_id += 1
            elif name == "free":
                pool.free(seq_id)
            else:
                pool.preempt(seq_id)
        pool.check_all()
        st_ = pool.m.stats()
        assert st_.blocks_used + st_.blocks_free == num_blocks
        assert 0 <= st_.blocks_cached_free <= st_.blocks_free
        assert st_.prefix_hits_tokens <= st_.prefix_queries_tokens

    for seq_id in list(pool.tokens):
        pool.free(seq_id)
    assert pool.m.audit() == []
    assert pool.m.num_free_blocks() == num_blocks
    assert pool.m.stats().tokens_used == 0
    assert all(block.ref_count == 0 for block in pool.m.block_pool.blocks)
