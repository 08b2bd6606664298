"""The /metrics page: valid Prometheus text from prometheus_client, with
vLLM's names under `paged:`, read from the engine's snapshot at scrape time."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from paged_server.entrypoints.openai.async_engine import AsyncEngine
from paged_server.entrypoints.openai.metrics import (
    ENGINE_METRICS,
    ServerMetrics,
    build_1_2_5_buckets,
)
from paged_server.sampling_params import SamplingParams

REQUIRED = [
    "paged:kv_cache_usage_perc", "paged:num_requests_running", "paged:num_requests_waiting",
    "paged:num_preemptions", "paged:prefix_cache_queries", "paged:prefix_cache_hits",
    "paged:prompt_tokens", "paged:generation_tokens", "paged:prefix_cache_misses",
    "paged:kv_audit_problems",
]
HISTOGRAMS = [
    "paged:time_to_first_token_seconds", "paged:inter_token_latency_seconds",
    "paged:request_time_per_output_token_seconds", "paged:e2e_request_latency_seconds",
    "paged:request_queue_time_seconds", "paged:request_prompt_tokens",
    "paged:request_generation_tokens",
]


def families(metrics: ServerMetrics) -> dict[str, Any]:
    """Parsed with prometheus_client's own parser: a malformed page raises."""
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def engine_snapshot() -> dict[str, float]:
    snap = {k: float(i) for i, k in enumerate(ENGINE_METRICS)}
    for i, reason in enumerate(("too_short", "evicted", "never_seen")):
        snap[f"prefix_cache_misses_{reason}_total"] = 10.0 + i
    return snap


def test_every_required_name_is_exposed_with_its_type() -> None:
    metrics = ServerMetrics("m")
    metrics.read_engine_from(engine_snapshot)
    fams = families(metrics)
    for name in REQUIRED:
        assert name in fams, name
        counter = ENGINE_METRICS.get(name.removeprefix("paged:") + "_total") or name.endswith("misses")
        assert fams[name].type == ("counter" if counter else "gauge"), name
    for name in HISTOGRAMS:
        assert fams[name].type == "histogram", name
    misses = {s.labels["reason"]: s.value for s in fams["paged:prefix_cache_misses"].samples}
    assert misses == {"too_short": 10.0, "evicted": 11.0, "never_seen": 12.0}
    usage = fams["paged:kv_cache_usage_perc"].samples[0]
    assert usage.labels == {"model_name": "m"}
    assert usage.value == engine_snapshot()["kv_cache_usage_perc"]


def test_snapshot_is_read_at_scrape_time() -> None:
    metrics = ServerMetrics("m")
    state = {"num_requests_waiting": 1.0}
    metrics.read_engine_from(lambda: state)
    assert families(metrics)["paged:num_requests_waiting"].samples[0].value == 1.0
    state["num_requests_waiting"] = 7.0
    assert families(metrics)["paged:num_requests_waiting"].samples[0].value == 7.0


def test_buckets_are_vllms() -> None:
    metrics = ServerMetrics("m", max_model_len=1000)
    fams = families(metrics)
    edges = [s.labels["le"] for s in fams["paged:request_prompt_tokens"].samples
             if s.name.endswith("_bucket")]
    assert edges == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "+Inf"]
    assert build_1_2_5_buckets(1) == [1]
    ttft = [s.labels["le"] for s in fams["paged:time_to_first_token_seconds"].samples
            if s.name.endswith("_bucket")]
    assert ttft[0] == "0.001" and ttft[-2] == "2560.0"


def test_two_apps_do_not_share_a_registry() -> None:
    a, b = ServerMetrics("a"), ServerMetrics("b")
    a.finished("stop", 3)
    assert a.num_finished("stop") == 3 and b.num_finished("stop") == 0


def test_label_values_are_escaped() -> None:
    metrics = ServerMetrics('we"ird\\name')
    metrics.finished("stop")
    (sample,) = families(metrics)["paged:request_success"].samples
    assert sample.labels == {"model_name": 'we"ird\\name', "finished_reason": "stop"}


def test_finished_requests_fill_the_per_request_histograms(fake_engine: Any) -> None:
    metrics = ServerMetrics("m")
    ae = AsyncEngine(fake_engine, metrics)
    ae.start()

    async def main() -> None:
        q: asyncio.Queue[Any] = asyncio.Queue()
        await ae.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, n=2), q,
                             arrival=time.monotonic(), num_choices=2)
        finished = 0
        while finished < 2:
            finished += sum(o.finished for o in await asyncio.wait_for(q.get(), 5))

    try:
        asyncio.run(main())
    finally:
        ae.stop()
    assert metrics.sample("e2e_request_latency_seconds_count") == 1
    assert metrics.sample("request_prompt_tokens_sum") == 3
    assert metrics.sample("request_generation_tokens_sum") == 8  # both choices
    assert metrics.sample("request_time_per_output_token_seconds_count") == 1
    assert metrics.sample("inter_token_latency_seconds_count") >= 6  # 3 gaps per choice at least
    assert metrics.num_finished("length") == 1  # one request (two choices)
    assert metrics.sample("request_params_n_sum") == 2
    assert metrics.sample("request_params_max_tokens_sum") == 4
    assert metrics.sample("request_max_num_generation_tokens_sum") == 4
    assert metrics.sample("request_decode_time_seconds_count") == 1
    assert metrics.sample("iteration_tokens_total_count") >= 4  # one per step that made tokens
