"""The /v1/responses store: least recently used out first, bounded by
count and by bytes, each entry whole (its conversation with it)."""

from __future__ import annotations

from paged_server.entrypoints.openai.response_store import ResponseStore


def _put(store: ResponseStore, rid: str, text: str = "x") -> bool:
    return store.put(rid, {"id": rid, "output_text": text}, [{"role": "user", "content": text}])


def test_least_recently_used_goes_first() -> None:
    store = ResponseStore(max_entries=3)
    for rid in ("a", "b", "c"):
        _put(store, rid)
    assert store.get("a") is not None  # a is now the most recent
    _put(store, "d")
    assert store.get("b") is None and len(store) == 3
    assert [rid for rid in ("a", "c", "d") if store.get(rid)] == ["a", "c", "d"]


def test_bytes_bound_and_replacing() -> None:
    store = ResponseStore(max_entries=100, max_bytes=1000)
    assert _put(store, "big", "y" * 300)  # ~650 bytes with its conversation
    assert _put(store, "small")
    assert _put(store, "big2", "z" * 300)  # over 1000 in all: the oldest goes
    assert store.get("big") is None and store.get("small") is not None and store.bytes <= 1000
    assert not _put(store, "huge", "w" * 1000)  # alone over the bound: not stored
    assert store.get("huge") is None
    _put(store, "small", "again")  # replacing keeps one entry and its size
    entry = store.get("small")
    assert entry is not None and entry.body["output_text"] == "again"
    assert store.bytes == sum(e.size for e in store._entries.values())
    assert store.delete("small") and not store.delete("small")
