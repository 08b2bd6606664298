"""What a vLLM operator reads: the metric families vLLM exports (with the
paged: prefix) and the periodic stats line."""

from __future__ import annotations

import logging
import re
from typing import Any

import httpx
import pytest

from paged_server.entrypoints.openai.stats_logger import StatsLogger

pytestmark = pytest.mark.e2e


def _value(page: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^paged:{name}\{{[^}}]*{labels}[^}}]*\}} (\S+)$", page, re.M)
    assert match, f"paged:{name} not exported"
    return float(match.group(1))


def test_vllm_metric_families_are_exported(http: httpx.Client, server: Any) -> None:
    before = _value(http.get("/metrics").text, "num_forks_total")
    body = {"prompt": "The metrics test prompt", "max_tokens": 4, "n": 3, "ignore_eos": True, "seed": 1}
    assert http.post("/v1/completions", json=body).status_code == 200
    page = http.get("/metrics").text
    assert _value(page, "num_forks_total") >= before + 2  # n=3: two forks of the first choice
    _value(page, "num_cow_copies_total")
    config = server.engine.config
    info = re.search(r"^paged:cache_config_info\{([^}]*)\} 1\.0$", page, re.M)
    assert info and f'block_size="{config.block_size}"' in info.group(1)
    assert f'num_gpu_blocks="{server.engine.capacity.num_blocks}"' in info.group(1)
    for family in ("request_inference_time_seconds", "request_prefill_time_seconds",
                   "request_decode_time_seconds", "request_params_n", "request_params_max_tokens",
                   "request_max_num_generation_tokens", "iteration_tokens_total"):
        assert _value(page, f"{family}_count") >= 1, family
    assert _value(page, "request_params_n_bucket", 'le="5.0"') >= 1


def test_stats_line_reports_throughput_and_stays_quiet_when_idle(caplog: pytest.LogCaptureFixture) -> None:
    stats = StatsLogger(interval_s=10.0)
    snap = {"prompt_tokens_total": 0.0, "generation_tokens_total": 0.0}
    start = stats._last_time
    assert stats.line(snap, start + 5) is None  # not due
    busy = {"prompt_tokens_total": 200.0, "generation_tokens_total": 50.0, "num_requests_running": 2.0,
            "num_requests_waiting": 1.0, "kv_cache_usage_perc": 0.25,
            "prefix_cache_queries_total": 100.0, "prefix_cache_hits_total": 40.0}
    line = stats.line(busy, start + 10)
    assert line == ("Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
                    "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 40.0%")
    idle = {**busy, "num_requests_running": 0.0, "num_requests_waiting": 0.0}
    assert stats.line(idle, start + 20) is None  # nothing ran since
    with caplog.at_level(logging.INFO, logger="paged_server.stats"):
        stats.maybe_log({**idle, "generation_tokens_total": 60.0}, start + 30)
    assert "Avg generation throughput: 1.0 tokens/s" in caplog.text
