"""Block manager bookkeeping cost per operation (pure Python, CPU).

256 sequences of 1,024 tokens each, driven the way the engine drives them:
admit every sequence with a 512-token prompt, then 512 decode rounds that
grow each sequence by one token, then free them all. The pool has exactly
the 16,384 blocks (block size 16) the sequences need.

Cases, side by side in one run:
- ``no_cache``: prefix caching off; no ``mark_computed`` calls.
- ``cache``: prefix caching on, distinct prompts, ``mark_computed`` after the
  prefill and after every decode step (as the pool calls it), so every full
  block is hashed and registered.
- ``cache_shared_prefix``: as ``cache``, but all prompts share their first 256
  tokens, so 255 of 256 prompts take 16 blocks as prefix hits.

Operations counted: one ``allocate``, 512 ``append`` and one ``free`` per
sequence (131,584 in all); ``mark_computed`` is part of the step it follows.
``extra_info["us_per_op"]`` is the mean round time divided by that count.

Run: ``pytest benchmarks/test_block_manager_bench.py --benchmark-only -p no:randomly``.
"""

from __future__ import annotations

import pytest

from paged_core import BlockManager

NUM_SEQS, PROMPT, DECODE, BLOCK_SIZE = 256, 512, 512, 16
NUM_BLOCKS = NUM_SEQS * (PROMPT + DECODE) // BLOCK_SIZE
OPS = NUM_SEQS * (1 + DECODE + 1)
SHARED = 256


def prompts(shared_prefix: bool) -> list[list[int]]:
    """Distinct token ids per sequence, optionally after one common prefix."""
    out = []
    for s in range(NUM_SEQS):
        own = [(s * PROMPT + i) % 50_000 + 1000 for i in range(PROMPT)]
        out.append(list(range(SHARED)) + own[SHARED:] if shared_prefix else own)
    return out


def serve_round(m: BlockManager, seqs: list[list[int]], track: bool) -> int:
    """Admit, decode and free every sequence; returns prefix-hit tokens."""
    hits = 0
    for s, tokens in enumerate(seqs):
        hits += m.allocate(s, tokens)
        if track:
            m.mark_computed(s, PROMPT)
    for step in range(DECODE):
        for s in range(NUM_SEQS):
            m.append(s, step)
            if track:
                m.mark_computed(s, PROMPT + step + 1)
    for s in range(NUM_SEQS):
        m.free(s)
    return hits


@pytest.mark.parametrize("case", ["no_cache", "cache", "cache_shared_prefix"])
def test_block_manager_allocate_append_free(benchmark, case):
    caching = case != "no_cache"
    seqs = prompts(shared_prefix=case == "cache_shared_prefix")

    def setup():
        return (
            BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=caching),
            seqs,
            caching,
        ), {}

    hits = benchmark.pedantic(serve_round, setup=setup, rounds=5, iterations=1)
    expected_hits = (NUM_SEQS - 1) * SHARED if case == "cache_shared_prefix" else 0
    assert hits == expected_hits
    benchmark.extra_info.update(
        ops=OPS,
        sequences=NUM_SEQS,
        tokens_per_sequence=PROMPT + DECODE,
        num_blocks=NUM_BLOCKS,
        us_per_op=benchmark.stats.stats.mean / OPS * 1e6,
    )
