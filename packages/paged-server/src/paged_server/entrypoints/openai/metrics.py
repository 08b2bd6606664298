"""Prometheus metrics in the text exposition format (0.0.4), written by hand.

Names follow vLLM's with a ``paged:`` prefix (``vllm:kv_cache_usage_perc`` ->
``paged:kv_cache_usage_perc``), so dashboards built for vLLM need only the
prefix changed. Engine gauges and counters come from ``LLMEngine.metrics()``
(a snapshot taken by the engine thread after each step); the latency
histograms are observed by the async front, where a client's wait is seen.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Mapping

PREFIX = "paged:"

# vLLM's bucket edges, in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

# engine.metrics() key -> (Prometheus type, help). Counters end in _total.
ENGINE_METRICS: dict[str, tuple[str, str]] = {
    "num_requests_running": ("gauge", "Requests in the running batch."),
    "num_requests_waiting": ("gauge", "Requests waiting to be scheduled."),
    "kv_cache_usage_perc": ("gauge", "Fraction of KV cache in use (1 = full)."),
    "kv_capacity_tokens": ("gauge", "KV cache capacity in tokens."),
    "kv_capacity_blocks": ("gauge", "KV cache capacity in blocks."),
    "num_preemptions_total": ("counter", "Sequences preempted (freed and requeued)."),
    "prefix_cache_queries_total": ("counter", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits_total": ("counter", "Prompt tokens found in the prefix cache."),
    "prompt_tokens_total": ("counter", "Prompt tokens processed."),
    "generation_tokens_total": ("counter", "Tokens generated."),
}


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(float(v))


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    esc = {k: v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for k, v in labels.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc.items()) + "}"


class Histogram:
    """A cumulative histogram; ``observe`` is thread-safe (engine thread + event loop)."""

    def __init__(self, name: str, help: str, buckets: Iterable[float]) -> None:
        self.name = PREFIX + name
        self.help = help
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)  # last: above every edge
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def render(self, labels: Mapping[str, str]) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for edge, c in zip(self.buckets, counts, strict=False):
            running += c
            out.append(f"{self.name}_bucket{_labels({**labels, 'le': _fmt(edge)})} {running}")
        running += counts[-1]
        out.append(f"{self.name}_bucket{_labels({**labels, 'le': '+Inf'})} {running}")
        out.append(f"{self.name}_sum{_labels(labels)} {_fmt(total)}")
        out.append(f"{self.name}_count{_labels(labels)} {running}")
        return out


class Counter:
    """A monotonically increasing, thread-safe counter (optionally labelled)."""

    def __init__(self, name: str, help: str) -> None:
        self.name = PREFIX + name
        self.help = help
        self._values: dict[tuple[tuple[str, str], ...], float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(tuple(sorted(labels.items())), 0.0)

    def render(self, labels: Mapping[str, str]) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        with self._lock:
            items = sorted(self._values.items())
        for key, v in items:
            out.append(f"{self.name}{_labels({**labels, **dict(key)})} {_fmt(v)}")
        return out


class ServerMetrics:
    """The metrics the HTTP front owns, plus rendering of the engine's snapshot."""

    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name}
        self.ttft = Histogram(
            "time_to_first_token_seconds", "Time from request arrival to its first token.", TTFT_BUCKETS
        )
        self.itl = Histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS
        )
        self.requests = Counter(
            "request_success_total", "Finished requests by finish reason (stop, length, abort, error)."
        )

    def render(self, engine_metrics: Mapping[str, float]) -> str:
        """The whole /metrics page: engine snapshot first, then the front's own."""
        lines: list[str] = []
        for key, (kind, help) in ENGINE_METRICS.items():
            if key not in engine_metrics:
                continue
            name = PREFIX + key
            lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
            lines.append(f"{name}{_labels(self.labels)} {_fmt(float(engine_metrics[key]))}")
        lines += self.ttft.render(self.labels)
        lines += self.itl.render(self.labels)
        lines += self.requests.render(self.labels)
        return "\n".join(lines) + "\n"
