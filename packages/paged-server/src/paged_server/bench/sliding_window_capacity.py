"""Sliding-window capacity: KV blocks a Gemma 3 sequence holds, hybrid KV cache groups vs one group.

Measured on real paged pools (``device="meta"``: sized, never allocated)
with the real Gemma 3 1B layout: 26 layers, 5 local (window 512) per global
one (global at layers 5, 11, 17, 23), 1 kv head x 256, bf16, block 16. For
each length L a sequence's prompt of L tokens is admitted and committed
(``mark_computed``), then the layer-blocks it holds are counted: one group
holds all 26 layers x L/16; the hybrid pool holds 4 x L/16 in its full
groups and 22 x min(L, W)/16 in its sliding ones (the formula column). The
sequences that fit a ``budget_bytes`` pool are admitted the same way until
the pool refuses the next prompt (its blocks are taken in every group before
its window is freed, so the last one needs L tokens' worth in every group).

With ``int4_block_size`` the row also has the hybrid pool storing
``kv_cache_dtype="int4"`` in blocks of that many tokens (64: key groups of
64 tokens, 3.56x a 16-bit cache's tokens), and ``int4_hybrid_vs_one_group``:
its sequences over the 16-bit single-group pool's, both in the same bytes
(the issue's moonshot: >= 15x at 8k).
"""

from __future__ import annotations

from typing import Any

import torch

GEMMA3_1B_WINDOWS = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
LENGTHS = (1024, 2048, 4096, 8192)


def _pool(budget_bytes: int, hybrid: bool, block_size: int, kv_cache_dtype: str = "auto") -> Any:
    from paged_core.kv_cache_groups import kv_cache_groups
    from paged_ref import PagedKVPool
    from paged_ref.kv_spec import KVCacheSpec

    groups = kv_cache_groups(GEMMA3_1B_WINDOWS, hybrid=hybrid)
    spec = KVCacheSpec(tuple(groups), 1, 256, torch.bfloat16, kv_cache_dtype, block_size)
    return PagedKVPool.from_spec(spec, spec.blocks_in(budget_bytes), "meta", enable_prefix_caching=False)


def _admit(pool: Any, length: int) -> int:
    """Admit and commit prompts of ``length`` tokens until one does not fit."""
    n = 0
    while pool.can_allocate_sequence([0] * length):
        seq_id, _ = pool.allocate_sequence([0] * length)
        pool.mark_computed(seq_id, length)
        n += 1
    return n


def sliding_window_capacity_row(
    length: int, budget_bytes: int, block_size: int = 16, int4_block_size: int | None = None
) -> dict[str, Any]:
    """One length: layer-blocks and bytes held per sequence, and sequences
    that fit ``budget_bytes``, hybrid vs one group (and hybrid int4, see
    the module doc)."""
    row: dict[str, Any] = {"tokens": length}
    window = 512
    globals_, locals_ = GEMMA3_1B_WINDOWS.count(None), 26 - GEMMA3_1B_WINDOWS.count(None)
    row["formula_layer_blocks"] = (globals_ * length + locals_ * min(length, window)) // block_size
    for name, hybrid in (("hybrid", True), ("one_group", False)):
        pool = _pool(budget_bytes, hybrid, block_size)
        seq_id, _ = pool.allocate_sequence([0] * length)
        pool.mark_computed(seq_id, length)
        blocks = pool.block_manager.num_blocks - pool.free_seq_count()
        row[f"{name}_layer_blocks"] = blocks * pool.num_cache_layers
        row[f"{name}_bytes"] = blocks * pool.kv_bytes() // pool.num_blocks
        pool.free_seq(seq_id)
        row[f"{name}_sequences"] = _admit(pool, length)
    row["saving"] = round(row["one_group_bytes"] / row["hybrid_bytes"], 2)
    if int4_block_size is not None:
        pool = _pool(budget_bytes, True, int4_block_size, "int4")
        seq_id, _ = pool.allocate_sequence([0] * length)
        pool.mark_computed(seq_id, length)
        blocks = pool.block_manager.num_blocks - pool.free_seq_count()
        row["hybrid_int4_bytes"] = blocks * pool.kv_bytes() // pool.num_blocks
        pool.free_seq(seq_id)
        row["hybrid_int4_sequences"] = _admit(pool, length)
        row["int4_saving"] = round(row["one_group_bytes"] / row["hybrid_int4_bytes"], 2)
        row["int4_hybrid_vs_one_group"] = round(
            row["hybrid_int4_sequences"] / max(1, row["one_group_sequences"]), 2
        )
    return row


def sliding_window_capacity_table(
    budget_bytes: int = 1 << 30, block_size: int = 16, lengths: tuple[int, ...] = LENGTHS,
    int4_block_size: int | None = 64,
) -> dict[str, Any]:  # fmt: skip
    """Every length in ``lengths`` for the Gemma 3 1B layout (module doc)."""
    return {
        "kind": "sliding_window_capacity",
        "layout": "Gemma 3 1B: 26 layers (22 local window 512, 4 global), 1 kv head x 256, bf16",
        "budget_bytes": budget_bytes,
        "block_size": block_size,
        "int4_block_size": int4_block_size,
        "rows": [
            sliding_window_capacity_row(n, budget_bytes, block_size, int4_block_size)
            for n in lengths
        ],
    }
