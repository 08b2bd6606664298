"""Why a prompt missed the prefix cache: too short, evicted, never seen.

The three miss counters and the hits add up to the queries, token for token,
so an operator can tell a cache that is too small (evictions) from traffic
that shares nothing (never seen) and prompts too short to ever hit."""

from __future__ import annotations

from paged_core import BlockManager

BS = 4


def misses(m: BlockManager) -> tuple[int, int, int]:
    st = m.stats()
    return (
        st.prefix_miss_too_short_tokens,
        st.prefix_miss_evicted_tokens,
        st.prefix_miss_never_seen_tokens,
    )


def admit_and_compute(m: BlockManager, seq_id: int, tokens: list[int]) -> int:
    hit = m.allocate(seq_id, tokens)
    m.mark_computed(seq_id, len(tokens))
    return hit


def assert_sums(m: BlockManager) -> None:
    st = m.stats()
    assert st.prefix_queries_tokens == st.prefix_hits_tokens + sum(misses(m))


def test_a_prompt_of_one_block_is_too_short_even_when_repeated() -> None:
    m = BlockManager(8, BS)
    prompt = [1, 2, 3, 4]  # exactly one block: its last token must be computed
    admit_and_compute(m, 1, prompt)
    assert admit_and_compute(m, 2, prompt) == 0
    assert misses(m) == (8, 0, 0)
    assert_sums(m)


def test_first_sight_is_never_seen_and_the_repeat_hits() -> None:
    m = BlockManager(8, BS)
    prompt = list(range(10))  # blocks [0-3] [4-7] matchable, [8,9] holds the last token
    admit_and_compute(m, 1, prompt)
    assert misses(m) == (2, 0, 8)
    assert admit_and_compute(m, 2, prompt) == 8
    assert misses(m) == (4, 0, 8)
    assert_sums(m)


def test_evicted_content_is_reported_as_evicted() -> None:
    m = BlockManager(3, BS)
    prompt = list(range(9))  # 3 blocks, 2 matchable
    admit_and_compute(m, 1, prompt)
    m.free(1)
    other = [100 + i for i in range(9)]
    admit_and_compute(m, 2, other)  # takes every block: evicts the cached ones
    m.free(2)
    assert m.stats().evictions == 2
    before = misses(m)
    assert admit_and_compute(m, 3, prompt) == 0
    after = misses(m)
    assert after[1] - before[1] == 8  # both matchable blocks: evicted
    assert after[2] == before[2]
    assert_sums(m)


def test_no_counting_when_prefix_caching_is_off() -> None:
    m = BlockManager(8, BS, enable_prefix_caching=False)
    admit_and_compute(m, 1, list(range(10)))
    assert misses(m) == (0, 0, 0)
    assert m.stats().prefix_queries_tokens == 0
