"""Conformance of classes that claim the cache protocols."""

from __future__ import annotations

import pytest

from paged_core import CachePoolProtocol, KVCacheProtocol


class _CompletePool:
    def allocate_seq(self, initial_tokens: int = 0) -> int:
        return 0

    def free_seq(self, seq_id: int) -> None: ...
    def get_num_computed_tokens(self, seq_id: int) -> int:
        return 0

    def free_seq_count(self) -> int:
        return 1

    def free_token_capacity(self) -> int | None:
        return None

    def prefill_view(self, seq_id): ...
    def decode_view(self, seq_ids): ...
    def batched_prefill_view(self, seq_ids, prompt_lens): ...
    def is_paged(self) -> bool:
        return False


POOL_MEMBERS = [
    "allocate_seq", "free_seq", "get_num_computed_tokens", "free_seq_count", "free_token_capacity",
    "prefill_view", "decode_view", "batched_prefill_view", "is_paged",
]


def test_complete_pool_conforms():
    assert isinstance(_CompletePool(), CachePoolProtocol)


@pytest.mark.parametrize("missing", POOL_MEMBERS)
def test_pool_missing_any_member_fails_conformance(missing):
    cls = type("Partial", (), {m: getattr(_CompletePool, m) for m in POOL_MEMBERS if m != missing})
    assert not isinstance(cls(), CachePoolProtocol)


def test_kv_cache_protocol_requires_seq_len_and_is_paged():
    class View:
        seq_len = 0

        def update(self, layer_idx, k, v):
            return k, v

        def advance(self, n): ...

    assert not isinstance(View(), KVCacheProtocol)
    View.is_paged = lambda self: False  # type: ignore[attr-defined]
    assert isinstance(View(), KVCacheProtocol)
