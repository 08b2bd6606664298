"""What one benchmark configuration reports, and the latency arithmetic.

Every runner (our engine on either KV backend, transformers' continuous
batching, transformers' static ``generate``) returns a ``RunResult`` so the
JSON lines, the results files and the results page share one schema.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paged_server.bench.workloads import Workload

SCHEMA_VERSION = 1

# Keys every printed JSON line carries (tests check them; the page reads them).
RESULT_KEYS = (
    "schema",
    "config",
    "workload",
    "model",
    "num_requests",
    "prompt_tokens",
    "output_tokens",
    "seconds",
    "tokens_per_s",
    "ttft_ms",
    "itl_ms",
    "peak_running",
    "peak_kv_usage",
    "peak_kv_pool_usage",
    "preemptions",
    "prefix_cache_hit_rate",
    "linear_seconds",
    "settings",
)


def percentiles(values: Iterable[float]) -> dict[str, float | None]:
    """p50/p90/p99 and mean (nearest-rank on the sorted values; None when empty)."""
    vals = sorted(values)
    if not vals:
        return {"p50": None, "p90": None, "p99": None, "mean": None}

    def rank(p: float) -> float:
        return vals[min(len(vals) - 1, max(0, math.ceil(p / 100 * len(vals)) - 1))]

    return {
        "p50": round(rank(50), 3),
        "p90": round(rank(90), 3),
        "p99": round(rank(99), 3),
        "mean": round(sum(vals) / len(vals), 3),
    }


class TokenTimes:
    """Arrival time of every generated token, per request, on one clock.

    TTFT is first token minus the burst start (all requests arrive at
    ``start``); inter-token latency is the gap between consecutive tokens of
    one request."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.times: dict[str, list[float]] = {}

    def record(self, request_id: str, num_tokens: int, when: float) -> None:
        self.times.setdefault(request_id, []).extend([when] * num_tokens)

    def ttft_ms(self) -> list[float]:
        return [(ts[0] - self.start) * 1e3 for ts in self.times.values() if ts]

    def itl_ms(self) -> list[float]:
        return [
            (b - a) * 1e3 for ts in self.times.values() for a, b in zip(ts, ts[1:], strict=False)
        ]


@dataclass(slots=True)
class RunResult:
    """One configuration run on one workload.

    ``peak_kv_usage`` is tokens held / token slots allocated to sequences, at
    the step where the most tokens were held (how much of the reserved KV
    memory holds real tokens: near 1 for paged, low for contiguous rows;
    above 1 when sequences share prefix blocks, which count once per sequence).
    ``peak_kv_pool_usage`` is the highest fraction of the whole pool's token
    slots allocated at any step. ``linear_seconds`` (our engine on a CPU) is
    the time spent inside the model's linear layers: the bound a perfect
    engine around the same matrix products would approach."""

    config: str
    workload: str
    model: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    ttft_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    peak_running: int | None = None
    peak_kv_usage: float | None = None
    peak_kv_pool_usage: float | None = None
    preemptions: int | None = None
    prefix_cache_hit_rate: float | None = None
    linear_seconds: float | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    timeline: list[dict[str, float]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self, *, timeline: bool = False) -> dict[str, Any]:
        """The JSON record (``timeline`` only when asked: it is long)."""
        d = asdict(self)
        if not timeline:
            d.pop("timeline")
        d["schema"] = SCHEMA_VERSION
        d["seconds"] = round(self.seconds, 4)  # 3 places were 2% of a 20 ms test run
        d["tokens_per_s"] = round(self.tokens_per_s, 2)
        for key in ("peak_kv_usage", "peak_kv_pool_usage", "prefix_cache_hit_rate"):
            if d[key] is not None:
                d[key] = round(d[key], 4)
        if self.linear_seconds is not None:
            d["linear_seconds"] = round(self.linear_seconds, 3)
            # Share of wall time in the linear layers = tokens/s as a share of the bound.
            d["linear_share"] = round(self.linear_seconds / self.seconds, 4) if self.seconds else None
        return d


def workload_result(
    runner: str,
    config: str,
    workload: Workload,
    model: str,
    produced: int,
    seconds: float,
    clock: TokenTimes,
    **measured: Any,
) -> RunResult:
    """The ``RunResult`` of ``config`` on ``workload``: its request and prompt
    counts, the ``produced`` tokens and ``clock``'s latency percentiles, plus
    the runner's own ``measured`` fields (peaks, settings...). Raises when
    ``runner`` produced other than the workload's tokens (EOS is ignored, so
    every backend must produce exactly them)."""
    if produced != workload.output_tokens:
        raise RuntimeError(
            f"{runner} produced {produced} tokens, the workload asks {workload.output_tokens}"
        )
    return RunResult(
        config=config,
        workload=workload.name,
        model=model,
        num_requests=len(workload.requests),
        prompt_tokens=workload.prompt_tokens,
        output_tokens=produced,
        seconds=seconds,
        ttft_ms=percentiles(clock.ttft_ms()),
        itl_ms=percentiles(clock.itl_ms()),
        **measured,
    )
