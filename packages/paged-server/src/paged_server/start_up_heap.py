"""Freeze what a serving process built at start-up, so the garbage
collector's full passes skip it.

Model, caches, compiled graphs and libraries live as long as the process
(hundreds of thousands of objects). Unfrozen, a full collection walks
them all while every thread waits: the server's TTFT p99 outliers. vLLM freezes its
engine's start-up heap for the same reason.
"""

from __future__ import annotations

import gc


def freeze() -> None:
    """Collect what is garbage now, then freeze everything left."""
    gc.collect()
    gc.freeze()


def unfreeze() -> None:
    """Give the frozen objects back to the collector (a server stopped in a
    process that goes on, such as a test run, leaves nothing pinned)."""
    gc.unfreeze()
