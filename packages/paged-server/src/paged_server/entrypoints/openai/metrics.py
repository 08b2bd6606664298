"""Prometheus metrics through ``prometheus_client``, one registry per app.

Names and meanings follow vLLM's with a ``paged:`` prefix
(``vllm:kv_cache_usage_perc`` -> ``paged:kv_cache_usage_perc``, same
buckets), so dashboards built for vLLM need only the prefix changed
(docs/serving.md has the table). Engine gauges and counters are read at
scrape time from ``LLMEngine.metrics()`` (a snapshot the engine thread takes
after each step), so each number keeps its one source; the per-request
histograms are observed by the async front, where a client's wait is seen.

Each app owns its own ``CollectorRegistry`` (never the global one), so two
servers in one process do not mix, and a multi-process deployment can add a
``MultiProcessCollector`` to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from paged_core import MISS_REASONS

# No *_created samples (as vLLM): they double the page and no dashboard uses them.
disable_created_metrics()

PREFIX = "paged:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket edges.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# engine.metrics() key -> (kind, help); exported as paged:<key>. Counter keys
# end in _total (the exposition adds it back to the family name).
ENGINE_METRICS: dict[str, tuple[str, str]] = {
    "num_requests_running": ("gauge", "Requests in the running batch."),
    "num_requests_waiting": ("gauge", "Requests waiting to be scheduled."),
    "kv_cache_usage_perc": ("gauge", "Fraction of KV cache in use (1 = full)."),
    "kv_capacity_tokens": ("gauge", "KV cache capacity in tokens."),
    "kv_capacity_blocks": ("gauge", "KV cache capacity in blocks."),
    "kv_cache_groups": ("gauge", "KV cache groups sharing the blocks (>1: sliding-window layers apart)."),
    "kv_audit_problems": ("gauge", "Problems the last KV block audit found (0 = clean)."),
    "kv_audits_total": ("counter", "KV block audits run (periodic, /health, admin)."),
    "num_preemptions_total": ("counter", "Sequences preempted (freed and requeued)."),
    "num_forks_total": ("counter", "Sequences forked from another (n > 1 choices, beams)."),
    "num_cow_copies_total": ("counter", "KV blocks copied on write (a shared block written to)."),
    "prefix_cache_queries_total": ("counter", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits_total": ("counter", "Prompt tokens found in the prefix cache."),
    "prompt_tokens_total": ("counter", "Prompt tokens processed."),
    "generation_tokens_total": ("counter", "Tokens generated."),
    # KV cache tiers (--kv-offloading-size, --kv-disk-dir): present only with them
    "kv_offload_hits_host_tokens_total": ("counter", "Prompt tokens restored from the host-memory KV tier."),
    "kv_offload_hits_disk_tokens_total": ("counter", "Prompt tokens restored from the disk KV tier."),
    "kv_offload_saved_blocks_total": ("counter", "KV blocks saved to the tiers."),
    "kv_offload_fetch_failures_total": ("counter", "Disk KV blocks refused on read (missing, corrupt, another model's)."),
    "kv_offload_bytes_saved_total": ("counter", "Bytes copied from the pool into the tiers (rank 0)."),
    "kv_offload_bytes_restored_total": ("counter", "Bytes restored from the tiers into the pool (rank 0)."),
    "kv_offload_bytes_read_from_disk_total": ("counter", "Bytes read from the disk tier (rank 0)."),
    "kv_offload_restore_seconds_total": ("counter", "Seconds spent restoring KV blocks (rank 0)."),
    "kv_offload_host_blocks": ("gauge", "KV blocks the host-memory tier holds."),
    "kv_offload_disk_blocks": ("gauge", "KV blocks the disk tier holds."),
    "spec_decode_num_drafts_total": ("counter", "Sequences whose speculative drafts a step checked."),
    "spec_decode_num_draft_tokens_total": ("counter", "Speculative draft tokens checked."),
    "spec_decode_num_accepted_tokens_total": ("counter", "Speculative draft tokens kept."),
}
SPEC_PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"
MISSES = "prefix_cache_misses"
# With --data-parallel-size: one sample per replica (label ``replica``), from
# the snapshot's ``dp_replica_<i>_<key>``; the keys above are all replicas summed.
REPLICA_METRICS: dict[str, tuple[str, str]] = {
    "num_requests_running": ("gauge", "Requests in the replica's running batch."),
    "num_requests_waiting": ("gauge", "Requests waiting in the replica's queue."),
    "kv_cache_usage_perc": ("gauge", "Fraction of the replica's KV cache in use."),
    "prefix_cache_queries_total": ("counter", "Prompt tokens the replica looked up in its prefix cache."),
    "prefix_cache_hits_total": ("counter", "Prompt tokens the replica found in its prefix cache."),
    "requests_routed_total": ("counter", "Requests the balancer sent to the replica."),
    "alive": ("gauge", "1 while the replica's process runs, 0 once it died."),
}
DP_METRICS: dict[str, tuple[str, str]] = {
    "dp_replicas_alive": ("gauge", "Data-parallel replicas running."),
    "dp_requests_routed_by_prefix_total": (
        "counter", "Requests the balancer sent to a replica for its cached prompt prefix.",
    ),
}


def _lora_info(snapshot: Mapping[str, float]) -> Iterator[Metric]:
    """vLLM's ``lora_requests_info`` (with --enable-lora): the adapters with
    requests running and waiting as comma-separated labels, the scrape's time
    as the value (vLLM's shape: dashboards read the labels)."""
    if "max_lora" not in snapshot:
        return
    names = {state: ",".join(sorted(k.split(":", 1)[1] for k in snapshot if k.startswith(f"lora_{state}:")))
             for state in ("running", "waiting")}  # fmt: skip
    info = GaugeMetricFamily(
        PREFIX + "lora_requests_info", "Running stats on lora requests.",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    info.add_metric([str(int(snapshot["max_lora"])), names["running"], names["waiting"]], time.time())
    yield info


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's length buckets)."""
    out: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


class _EngineCollector(Collector):
    """Engine gauges and counters, read from the latest snapshot at scrape time."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.source: Callable[[], Mapping[str, float]] = dict

    def collect(self) -> Iterator[Metric]:
        snapshot = self.source()
        labels = [self.model_name]
        for key, (kind, help) in (ENGINE_METRICS | DP_METRICS).items():
            if key not in snapshot:
                continue
            family: GaugeMetricFamily | CounterMetricFamily
            if kind == "gauge":
                family = GaugeMetricFamily(PREFIX + key, help, labels=["model_name"])
            else:
                family = CounterMetricFamily(PREFIX + key, help, labels=["model_name"])
            family.add_metric(labels, float(snapshot[key]))
            yield family
        misses = CounterMetricFamily(
            PREFIX + MISSES,
            "Prompt tokens not served from the prefix cache, by reason: too_short (the "
            "block holding the last prompt token is never matched), evicted, never_seen.",
            labels=["model_name", "reason"],
        )
        for reason in MISS_REASONS:
            key = f"{MISSES}_{reason}_total"
            if key in snapshot:
                misses.add_metric([self.model_name, reason], float(snapshot[key]))
        per_position = CounterMetricFamily(
            PREFIX + SPEC_PER_POSITION, "Speculative draft tokens kept, by draft position (0 first).",
            labels=["model_name", "position"],
        )
        for key, value in snapshot.items():
            if key.startswith("spec_decode_num_accepted_tokens_position_"):
                position = key.removeprefix("spec_decode_num_accepted_tokens_position_").removesuffix("_total")
                per_position.add_metric([self.model_name, position], float(value))
        if per_position.samples:
            yield per_position
        if misses.samples:
            yield misses
        groups = GaugeMetricFamily(
            PREFIX + "kv_cache_group_blocks_used",
            "KV blocks each KV cache group's page tables hold (a hybrid pool's groups "
            "share one pool of blocks; sliding-window groups give theirs back).",
            labels=["model_name", "group"],
        )
        for g in range(int(snapshot.get("kv_cache_groups", 1))):
            key = f"kv_group_{g}_blocks_used"
            if key in snapshot:
                groups.add_metric([self.model_name, str(g)], float(snapshot[key]))
        if groups.samples:
            yield groups
        yield from _lora_info(snapshot)
        yield from self._per_replica(snapshot)

    def _per_replica(self, snapshot: Mapping[str, float]) -> Iterator[Metric]:
        """``paged:dp_replica_<key>{replica="i"}`` (data parallelism only)."""
        if "dp_replicas_alive" not in snapshot:
            return
        count = sum(1 for k in snapshot if k.startswith("dp_replica_") and k.endswith("_alive"))
        for key, (kind, help) in REPLICA_METRICS.items():
            name = PREFIX + "dp_replica_" + key
            family: GaugeMetricFamily | CounterMetricFamily
            if kind == "gauge":
                family = GaugeMetricFamily(name, help, labels=["model_name", "replica"])
            else:
                family = CounterMetricFamily(name, help, labels=["model_name", "replica"])
            for i in range(count):
                value = snapshot.get(f"dp_replica_{i}_{key}")
                if value is not None:
                    family.add_metric([self.model_name, str(i)], float(value))
            yield family


class ServerMetrics:
    """The app's registry: the engine's snapshot plus the front's histograms."""

    def __init__(self, model_name: str, max_model_len: int = 4096) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._engine = _EngineCollector(model_name)
        self.registry.register(self._engine)

        def histogram(name: str, help: str, buckets: tuple[float, ...] | list[int]) -> Histogram:
            return Histogram(
                PREFIX + name, help, ["model_name"], buckets=buckets, registry=self.registry
            )

        self.ttft = histogram(
            "time_to_first_token_seconds", "Time from request arrival to its first token.",
            TTFT_BUCKETS,
        ).labels(model_name)
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS
        ).labels(model_name)
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Per request: time from the first to the last token over the tokens after the first.",
            ITL_BUCKETS,
        ).labels(model_name)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Time from request arrival to its last token.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(model_name)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time a request waited before its first admission.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(model_name)
        lengths = build_1_2_5_buckets(max_model_len)
        self.prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length of finished requests.", lengths
        ).labels(model_name)
        self.generation_tokens = histogram(
            "request_generation_tokens",
            "Tokens generated per finished request (all choices).",
            lengths,
        ).labels(model_name)
        self.max_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Most tokens any one choice of a finished request generated.", lengths,
        ).labels(model_name)
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens finished requests asked for.", lengths
        ).labels(model_name)
        self.params_n = histogram(
            "request_params_n", "The n (choices) finished requests asked for.", PARAMS_N_BUCKETS
        ).labels(model_name)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens (prompt and generated) per engine step.",
            ITERATION_TOKENS_BUCKETS,
        ).labels(model_name)
        self.inference_time = histogram(
            "request_inference_time_seconds", "Time from first admission to the last token.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(model_name)
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "Time from first admission to the first token.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(model_name)
        self.decode_time = histogram(
            "request_decode_time_seconds", "Time from the first token to the last.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(model_name)
        self._success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason (stop, length, abort, error; with n > 1: "
            "the last choice's).",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )

    def set_cache_config(self, **labels: str) -> None:
        """``cache_config_info``: the KV cache's settings as labels of a 1 (vLLM's)."""
        info = Gauge(PREFIX + "cache_config_info", "Information of the KV cache config.",
                     sorted(labels), registry=self.registry)
        info.labels(**labels).set(1)

    def read_engine_from(self, source: Callable[[], Mapping[str, float]]) -> None:
        """Where scrapes read the engine's snapshot (``AsyncEngine.metrics``)."""
        self._engine.source = source

    def finished(self, reason: str, count: int = 1) -> None:
        """Count ``count`` requests that ended with ``reason``."""
        if count > 0:
            self._success.labels(self.model_name, reason).inc(count)

    def sample(self, name: str, **labels: str) -> float:
        """One sample's value (0 if absent), e.g. ``sample("e2e_request_latency_seconds_count")``."""
        value = self.registry.get_sample_value(
            PREFIX + name, {"model_name": self.model_name, **labels}
        )
        return value or 0.0

    def num_finished(self, reason: str) -> float:
        """Requests counted as finished with ``reason`` so far."""
        return self.sample("request_success_total", finished_reason=reason)

    def render(self) -> bytes:
        """The whole /metrics page (Prometheus text format 0.0.4)."""
        return generate_latest(self.registry)
