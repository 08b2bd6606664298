"""The engine's counters and the ``metrics()`` snapshot built from them.

One source for each number: the engine counts what only it sees (prompt and
generated tokens, preemptions, which the scheduler decides); the pool's
``stats()`` (the block manager's counters) gives prefix-cache queries, hits
and misses by reason. Nothing is counted in two places.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from paged_core import MISS_REASONS
from paged_core.protocols import KVCacheManagerProtocol
from paged_server.engine.kv.pool_factory import PoolCapacity


@dataclass(slots=True)
class EngineCounters:
    """Monotonic totals since the engine started, and the last audit's result."""

    preemptions: int = 0
    prompt_tokens: int = 0  # each request's prompt once (not recomputes)
    generation_tokens: int = 0
    audit_problems: int = 0  # findings of the last audit (0 when clean)
    audits: int = 0
    # Speculative decoding (vLLM's names): sequences that checked drafts, the
    # drafts checked, those kept, and those kept at each draft position.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)

    def count_drafts(self, num_drafts: int, num_accepted: int) -> None:
        """One sequence's checked drafts, ``num_accepted`` of them kept (a prefix)."""
        if not num_drafts:
            return
        self.spec_drafts += 1
        self.spec_draft_tokens += num_drafts
        self.spec_accepted_tokens += num_accepted
        per = self.spec_accepted_per_position
        per += [0] * (num_drafts - len(per))
        for i in range(num_accepted):
            per[i] += 1

    def snapshot(
        self,
        pool: KVCacheManagerProtocol,
        capacity: PoolCapacity,
        num_running: int,
        num_waiting: int,
    ) -> dict[str, float]:
        """``metrics()``: ``kv_cache_usage_perc`` is a fraction in [0, 1] (as in
        vLLM): blocks in use, or seq_ids in use for the contiguous pool."""
        if capacity.num_rows is None:
            free = pool.free_token_capacity() or 0
            usage = 1.0 - free / capacity.tokens if capacity.tokens else 0.0
        else:
            usage = 1.0 - pool.free_seq_count() / capacity.num_rows
        stats = pool.stats()  # the contiguous pool has no prefix cache: zeros
        out = {
            "num_requests_running": float(num_running),
            "num_requests_waiting": float(num_waiting),
            "kv_cache_usage_perc": usage,
            "num_preemptions_total": float(self.preemptions),
            "num_forks_total": float(stats.get("forks", 0)),
            "num_cow_copies_total": float(stats.get("cow_copies", 0)),
            "prefix_cache_queries_total": float(stats.get("prefix_queries_tokens", 0)),
            "prefix_cache_hits_total": float(stats.get("prefix_hits_tokens", 0)),
            "prompt_tokens_total": float(self.prompt_tokens),
            "generation_tokens_total": float(self.generation_tokens),
            "kv_capacity_tokens": float(capacity.tokens),
            "kv_capacity_blocks": float(capacity.num_blocks),
            "kv_cache_groups": float(capacity.num_groups),
            "kv_audit_problems": float(self.audit_problems),
            "kv_audits_total": float(self.audits),
            "spec_decode_num_drafts_total": float(self.spec_drafts),
            "spec_decode_num_draft_tokens_total": float(self.spec_draft_tokens),
            "spec_decode_num_accepted_tokens_total": float(self.spec_accepted_tokens),
        }
        for i, kept in enumerate(self.spec_accepted_per_position):
            out[f"spec_decode_num_accepted_tokens_position_{i}_total"] = float(kept)
        for reason in MISS_REASONS:
            key = f"prefix_miss_{reason}_tokens"
            out[f"prefix_cache_misses_{reason}_total"] = float(stats.get(key, 0))
        for g in range(capacity.num_groups if capacity.num_groups > 1 else 0):
            out[f"kv_group_{g}_blocks_used"] = float(stats.get(f"group_{g}_blocks_used", 0))
        return out


class RateLimitedLog:
    """At most one line per ``interval_s``; the lines held back are counted
    and their number is told with the next line that goes out."""

    def __init__(self, logger: logging.Logger, interval_s: float = 5.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last = -float("inf")
        self._held_back = 0

    def warning(self, msg: str, *args: object) -> bool:
        """Log (or count) one warning; returns whether it was written."""
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._held_back += 1
            return False
        if self._held_back:
            msg += " (%d similar message(s) held back in the last %.0f s)"
            args = (*args, self._held_back, self.interval_s)
        self.logger.warning(msg, *args)
        self._last, self._held_back = now, 0
        return True
