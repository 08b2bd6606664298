"""KV cache groups: a model's layers partitioned by attention type, k layers each.

Layers that attend the same way (full attention, or a sliding window of W
tokens) can share page tables: their blocks live and die together. A group
holds ``k`` layers of one type, ``k`` being the gcd of the per-type layer
counts, so every type splits into whole groups with no padding (Gemma 3 1B:
4 global + 22 local layers -> k = 2, 2 full groups and 11 sliding ones).
Every group then stores the same bytes per block (``k`` layers' worth), so
one pool of blocks serves them all: layer ``l`` lives at *cache layer*
``j`` (the cache tensors' first index) inside its group's blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["KVCacheGroup", "kv_cache_groups", "cache_layers", "stage_groups"]


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """``layers`` (model layer indices, ascending) that share page tables;
    ``sliding_window`` is their window in tokens (None: full attention)."""

    layers: tuple[int, ...]
    sliding_window: int | None


def kv_cache_groups(layer_windows: list[int | None], *, hybrid: bool = True) -> list[KVCacheGroup]:
    """The groups of a model whose layer ``i`` attends with window
    ``layer_windows[i]`` (None = full). Full-attention groups come first,
    then sliding ones by window; within a type, layers in order. With
    ``hybrid=False`` (vLLM's ``disable_hybrid_kv_cache_manager``) or a single
    attention type: one group of every layer, whose window is the layers'
    common one (None when they differ, so no block is ever freed early)."""
    if not layer_windows:
        raise ValueError("a model needs at least one layer to build KV cache groups")
    bad = [w for w in layer_windows if w is not None and w < 1]
    if bad:
        raise ValueError(f"sliding windows must be >= 1 token, got {bad[0]}")
    by_type: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_type.setdefault(window, []).append(layer)
    if len(by_type) == 1 or not hybrid:
        common = layer_windows[0] if len(by_type) == 1 else None
        return [KVCacheGroup(tuple(range(len(layer_windows))), common)]
    k = math.gcd(*(len(layers) for layers in by_type.values()))
    order = sorted(by_type, key=lambda w: (w is not None, w or 0))
    return [
        KVCacheGroup(tuple(by_type[w][i : i + k]), w)
        for w in order
        for i in range(0, len(by_type[w]), k)
    ]


def stage_groups(groups: list[KVCacheGroup], layers: range) -> list[KVCacheGroup]:
    """The groups as a pipeline stage holding ``layers`` stores them: the
    same groups (one page table each, shared by every stage), each keeping
    only its layers in ``layers``, maybe none. The stage's tensors need as
    many cache layers as its fullest group has."""
    return [
        KVCacheGroup(tuple(layer for layer in g.layers if layer in layers), g.sliding_window)
        for g in groups
    ]


def cache_layers(groups: list[KVCacheGroup]) -> dict[int, tuple[int, int]]:
    """Model layer -> ``(group index, cache layer)``: where its KV lives."""
    return {layer: (g, j) for g, group in enumerate(groups) for j, layer in enumerate(group.layers)}
