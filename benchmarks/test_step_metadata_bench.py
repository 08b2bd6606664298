"""Host cost of preparing one decode step's metadata (CPU, no forward pass).

256 running sequences, each with a long cached context, on a paged pool
with one layer of one 1-wide head (so KV memory stays small: only page
tables and metadata matter here). One round is what the engine does on the host before a decode
forward: reserve room for each sequence's new token (``append_token``; a
new block every 16th step), then build the step's view
(``step_view``: page tables gathered from the mirrored host rows, seq_id
mapping, lengths, decode/prefill split).

Cases, side by side in one run: 4,096-token and 32,768-token contexts
(65,536 vs 524,288 blocks held). The issue's target is <= 1 ms per step at
4,096 tokens, and a cost that follows the blocks added in the step, not
the blocks held: the two cases' Python work is the same (one append and one
table row per sequence); only the int32 table copy grows with context
(``[256, width]``, 256 KB vs 2 MB).

Run: ``pytest benchmarks/test_step_metadata_bench.py --benchmark-only -p no:randomly``.
"""

from __future__ import annotations

import pytest
import torch

from paged_core import kv_cache_groups
from paged_ref import PagedKVPool

NUM_SEQS, BLOCK_SIZE = 256, 16


def build(context: int) -> tuple[PagedKVPool, list[int], list[int]]:
    blocks = NUM_SEQS * (context // BLOCK_SIZE + 8)  # room for the rounds below
    pool = PagedKVPool.from_model_config(
        1, 1, 1, blocks, BLOCK_SIZE, torch.float32, enable_prefix_caching=False
    )
    seq_ids = [pool.allocate_sequence([1] * context)[0] for _ in range(NUM_SEQS)]
    for seq_id in seq_ids:
        pool.mark_computed(seq_id, context - 1)
    # ``advance`` commits the token at ``context - 1`` first, then reserves the next.
    return pool, seq_ids, [context - 2] * NUM_SEQS


def advance(pool: PagedKVPool, seq_ids: list[int], starts: list[int]) -> None:
    """What the engine does around the metadata: commit last step's token,
    then reserve room for this step's (a new block every 16th step)."""
    for i, seq_id in enumerate(seq_ids):
        starts[i] += 1
        pool.mark_computed(seq_id, starts[i])
        pool.append_token(seq_id, 7)


@pytest.mark.parametrize("context", [4096, 32768])
def test_decode_step_metadata(benchmark, context: int) -> None:
    """The step's metadata alone: ``step_view`` (the issue's target)."""
    pool, seq_ids, starts = build(context)
    ones = [1] * NUM_SEQS
    benchmark.pedantic(
        lambda: pool.step_view(seq_ids, starts, ones),
        setup=lambda: advance(pool, seq_ids, starts),
        rounds=64,
        warmup_rounds=2,
    )
    benchmark.extra_info.update(
        {"sequences": NUM_SEQS, "context_tokens": context, "blocks_held": pool.num_blocks - pool.free_seq_count()}
    )


@pytest.mark.parametrize("context", [4096, 32768])
def test_decode_step_host_work(benchmark, context: int) -> None:
    """Commit + reserve + metadata: all the host bookkeeping of a decode step."""
    pool, seq_ids, starts = build(context)
    ones = [1] * NUM_SEQS

    def step() -> None:
        advance(pool, seq_ids, starts)
        pool.step_view(seq_ids, starts, ones)

    benchmark.pedantic(step, rounds=64, warmup_rounds=2)
    benchmark.extra_info.update({"sequences": NUM_SEQS, "context_tokens": context})


# Gemma 3 1B's layer pattern: 5 sliding (window 512) then 1 global, 26 layers.
GEMMA3_1B_WINDOWS = [None if i % 6 == 5 else 512 for i in range(26)]
HYBRID_SEQS, HYBRID_CONTEXT = 64, 4096


@pytest.mark.parametrize("hybrid", [False, True], ids=["one_group", "hybrid_13_groups"])
def test_decode_step_host_work_hybrid(benchmark, hybrid: bool) -> None:
    """The same host work on the Gemma 3 1B layout, with KV cache groups
    (13: each a page table to grow, commit and gather) or one group: what
    sliding-window freeing costs the host per decode step."""
    per_group = HYBRID_SEQS * (HYBRID_CONTEXT // BLOCK_SIZE + 8)
    pool = PagedKVPool.from_model_config(
        26, 1, 1, per_group * 13 + 1, BLOCK_SIZE, torch.float32, enable_prefix_caching=False,
        groups=kv_cache_groups(GEMMA3_1B_WINDOWS, hybrid=hybrid),
    )  # fmt: skip
    seq_ids = [pool.allocate_sequence([1] * HYBRID_CONTEXT)[0] for _ in range(HYBRID_SEQS)]
    for seq_id in seq_ids:
        pool.mark_computed(seq_id, HYBRID_CONTEXT - 1)
    starts = [HYBRID_CONTEXT - 2] * HYBRID_SEQS
    ones = [1] * HYBRID_SEQS

    def step() -> None:
        advance(pool, seq_ids, starts)
        pool.step_view(seq_ids, starts, ones)

    benchmark.pedantic(step, rounds=64, warmup_rounds=2)
    benchmark.extra_info.update(
        {"sequences": HYBRID_SEQS, "context_tokens": HYBRID_CONTEXT, "kv_cache_groups": len(pool.groups)}
    )
