"""The in-memory store of /v1/responses (``store: true``): what
``previous_response_id`` continues and ``GET /v1/responses/{id}`` returns.

Least recently used first out, bounded twice: at most ``max_entries``
responses and ``max_bytes`` of their JSON. Each entry keeps its whole
conversation (so a chain survives its older links being evicted), which
makes long chains the big entries. Everything lives in the API process and
is gone on restart; the event loop is its only user, so it needs no lock.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 << 20  # 64 MiB


@dataclass(slots=True)
class StoredResponse:
    """A response and the conversation it ended (chat messages, its
    instructions left out: the next request brings its own)."""

    body: dict[str, Any]
    messages: list[dict[str, Any]]
    size: int


class ResponseStore:
    """Response id -> ``StoredResponse``, least recently used evicted first."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, body: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
        """Store (or replace) a response; ``False`` when it alone is over ``max_bytes``."""
        self.delete(response_id)
        size = len(json.dumps(body)) + len(json.dumps(messages))
        if size > self.max_bytes:
            return False
        self._entries[response_id] = StoredResponse(body, messages, size)
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, now the most recently used; ``None`` if unknown or evicted."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
