"""The engine's counters and the ``metrics()`` snapshot built from them."""

from __future__ import annotations

from dataclasses import dataclass

from paged_core.protocols import ServingPoolProtocol
from paged_server.engine.pool_factory import PoolCapacity


@dataclass(slots=True)
class EngineCounters:
    """Monotonic totals since the engine started."""

    preemptions: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens served from it
    prompt_tokens: int = 0  # each request's prompt once (not recomputes)
    generation_tokens: int = 0

    def snapshot(
        self,
        pool: ServingPoolProtocol,
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
        return {
            "num_requests_running": float(num_running),
            "num_requests_waiting": float(num_waiting),
            "kv_cache_usage_perc": usage,
            "num_preemptions_total": float(self.preemptions),
            "prefix_cache_queries_total": float(self.prefix_queries),
            "prefix_cache_hits_total": float(self.prefix_hits),
            "prompt_tokens_total": float(self.prompt_tokens),
            "generation_tokens_total": float(self.generation_tokens),
            "kv_capacity_tokens": float(capacity.tokens),
            "kv_capacity_blocks": float(capacity.num_blocks),
        }
