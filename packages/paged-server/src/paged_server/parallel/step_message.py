"""What rank 0 tells the other ranks: one worker call at a time, in order.

Every rank runs the same ``Worker``; rank 0 (the engine's process) makes
each call on its own worker right after broadcasting it, so every rank
makes the same calls in the same order and their collectives meet: the
start-up calls (load, calibrate, size, build the cache, warm up) and then
one ``execute`` per step, whose ``WorkerStep`` carries the token ids and
the KV cache manager's layout (page tables, positions, the block copies
copy-on-write asked for). Workers keep no block manager: every rank's KV
shard holds its heads of the same tokens in the same blocks because every
rank gets the same layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class WorkerCall:
    """``Worker.<method>(*args)`` on every rank, or ``stop`` (the engine is
    shutting down). ``handshake``: a start-up call after which every rank
    reports whether it succeeded (``TPGroup.barrier_ok``)."""

    method: str = ""
    args: tuple[Any, ...] = field(default_factory=tuple)
    handshake: bool = False
    stop: bool = False
