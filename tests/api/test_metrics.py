"""The /metrics page is valid Prometheus text with vLLM's names under `paged:`."""

from __future__ import annotations

import re

from paged_server.entrypoints.openai.metrics import ENGINE_METRICS, Histogram, ServerMetrics

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_]+="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')

REQUIRED = [
    "paged:kv_cache_usage_perc", "paged:num_requests_running", "paged:num_requests_waiting",
    "paged:num_preemptions_total", "paged:prefix_cache_queries_total", "paged:prefix_cache_hits_total",
    "paged:prompt_tokens_total", "paged:generation_tokens_total",
]


def parse(text: str) -> tuple[dict[str, str], dict[str, float]]:
    """(family -> type, 'name{labels}' -> value); asserts every line is well formed."""
    types: dict[str, str] = {}
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line.startswith("# HELP "):
            continue
        else:
            m = SAMPLE.match(line)
            assert m, f"malformed sample line: {line!r}"
            samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return types, samples


def engine_snapshot() -> dict[str, float]:
    return {k: float(i) for i, k in enumerate(ENGINE_METRICS)}


def test_every_required_name_is_exposed_with_its_type() -> None:
    metrics = ServerMetrics("m")
    types, samples = parse(metrics.render(engine_snapshot()))
    for name in REQUIRED:
        assert name in types
        assert f'{name}{{model_name="m"}}' in samples
        assert types[name] == ("counter" if name.endswith("_total") else "gauge")
    assert types["paged:time_to_first_token_seconds"] == "histogram"
    assert types["paged:inter_token_latency_seconds"] == "histogram"


def test_histogram_buckets_are_cumulative_and_count_matches() -> None:
    h = Histogram("x_seconds", "help", [0.1, 1.0])
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    _, samples = parse("\n".join(h.render({"model_name": "m"})))
    assert samples['paged:x_seconds_bucket{model_name="m",le="0.1"}'] == 2  # le is inclusive
    assert samples['paged:x_seconds_bucket{model_name="m",le="1.0"}'] == 3
    assert samples['paged:x_seconds_bucket{model_name="m",le="+Inf"}'] == 4
    assert samples['paged:x_seconds_count{model_name="m"}'] == 4
    assert abs(samples['paged:x_seconds_sum{model_name="m"}'] - 3.65) < 1e-9


def test_label_values_are_escaped() -> None:
    metrics = ServerMetrics('we"ird\\name')
    metrics.requests.inc(finished_reason="stop")
    _, samples = parse(metrics.render({}))
    assert 'paged:request_success_total{model_name="we\\"ird\\\\name",finished_reason="stop"}' in samples
