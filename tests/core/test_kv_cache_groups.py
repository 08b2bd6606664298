"""KV cache groups: layers partitioned by attention type into gcd-sized groups."""

from __future__ import annotations

import pytest

from paged_core import KVCacheGroup, cache_layers, kv_cache_groups

W = 512
# Gemma 3 1B: 26 layers, every 6th (5, 11, 17, 23) global, the rest slide.
GEMMA3_1B = [None if (i + 1) % 6 == 0 else W for i in range(26)]


def test_gemma3_1b_splits_into_13_groups_of_2() -> None:
    groups = kv_cache_groups(GEMMA3_1B)
    assert len(groups) == 13
    assert all(len(g.layers) == 2 for g in groups)
    assert groups[:2] == [KVCacheGroup((5, 11), None), KVCacheGroup((17, 23), None)]
    assert all(g.sliding_window == W for g in groups[2:])
    assert groups[2].layers == (0, 1)
    assert sorted(layer for g in groups for layer in g.layers) == list(range(26))


def test_one_attention_type_is_one_group_of_every_layer() -> None:
    assert kv_cache_groups([None] * 4) == [KVCacheGroup((0, 1, 2, 3), None)]
    assert kv_cache_groups([8] * 3) == [KVCacheGroup((0, 1, 2), 8)]


def test_disabled_hybrid_manager_keeps_one_full_group() -> None:
    assert kv_cache_groups([8, None, 8], hybrid=False) == [KVCacheGroup((0, 1, 2), None)]


def test_coprime_counts_give_groups_of_one_layer() -> None:
    groups = kv_cache_groups([8, 8, None, 8, 8, 8])  # 1 global, 5 local: k = 1
    assert [g.layers for g in groups] == [(2,), (0,), (1,), (3,), (4,), (5,)]
    assert cache_layers(groups)[2] == (0, 0) and cache_layers(groups)[5] == (5, 0)


def test_two_windows_and_cache_layers() -> None:
    groups = kv_cache_groups([4, 4, 8, 8, None, None])
    assert [(g.layers, g.sliding_window) for g in groups] == [
        ((4, 5), None),
        ((0, 1), 4),
        ((2, 3), 8),
    ]
    assert cache_layers(groups) == {4: (0, 0), 5: (0, 1), 0: (1, 0), 1: (1, 1), 2: (2, 0), 3: (2, 1)}


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="at least one layer"):
        kv_cache_groups([])
    with pytest.raises(ValueError, match="sliding windows must be >= 1"):
        kv_cache_groups([0, None])
