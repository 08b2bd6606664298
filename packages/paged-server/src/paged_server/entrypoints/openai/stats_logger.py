"""The periodic stats line vLLM operators read in the server log (off with
``--disable-log-stats``): prompt and generation throughput since the last
line, requests running and waiting, KV cache usage, prefix-cache hit rate,
and with speculative decoding the draft acceptance rate.
Written only when something ran since the last line, so an idle server is quiet."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

logger = logging.getLogger("paged_server.stats")

LOG_STATS_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL


class StatsLogger:
    """Turns successive engine snapshots into one line every ``interval_s``."""

    def __init__(self, interval_s: float = LOG_STATS_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._last: dict[str, float] = {}

    def line(self, snapshot: Mapping[str, float], now: float) -> str | None:
        """The line due at ``now`` for ``snapshot``, or ``None`` (not due, or idle)."""
        if now - self._last_time < self.interval_s:
            return None
        elapsed, self._last_time = now - self._last_time, now

        def delta(key: str) -> float:
            return float(snapshot.get(key, 0.0)) - self._last.get(key, 0.0)

        prompt, generated = delta("prompt_tokens_total"), delta("generation_tokens_total")
        queries, hits = delta("prefix_cache_queries_total"), delta("prefix_cache_hits_total")
        running = snapshot.get("num_requests_running", 0.0)
        waiting = snapshot.get("num_requests_waiting", 0.0)
        self._last = {k: float(v) for k, v in snapshot.items()}
        if not (prompt or generated or running or waiting):
            return None
        text = (
            f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {generated / elapsed:.1f} tokens/s, "
            f"Running: {running:.0f} reqs, Waiting: {waiting:.0f} reqs, "
            f"KV cache usage: {100 * snapshot.get('kv_cache_usage_perc', 0.0):.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
        )
        drafts = delta("spec_decode_num_draft_tokens_total")
        if drafts:  # speculative decoding ran (vLLM's SpecDecoding line, in short)
            kept = delta("spec_decode_num_accepted_tokens_total")
            text += f", Spec decode acceptance rate: {100 * kept / drafts:.1f}% of {drafts:.0f} drafts"
        return text

    def maybe_log(self, snapshot: Mapping[str, float], now: float | None = None) -> None:
        """Log the line if one is due."""
        text = self.line(snapshot, time.monotonic() if now is None else now)
        if text is not None:
            logger.info("%s", text)
