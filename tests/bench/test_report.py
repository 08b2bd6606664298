"""The results page and plots are rendered from the JSON files alone, and
show the numbers those files hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paged_server.bench.capacity import capacity_table
from paged_server.bench.environment import describe_environment
from paged_server.bench.results import RunResult, percentiles


@pytest.fixture
def report_module():  # type: ignore[no-untyped-def]
    import report

    return report


def _run(config: str, tokens_per_s: float, peak_running: int) -> dict:
    timeline = [
        {
            "t": 0.1 * i,
            "running": peak_running,
            "waiting": 0,
            "tokens_held": 100.0 * i,
            "slots_allocated": 112.0 * i,
            "pool_usage": 0.0,
        }
        for i in range(1, 4)
    ]
    r = RunResult(
        config=config,
        workload="seed",
        model="m",
        num_requests=4,
        prompt_tokens=40,
        output_tokens=int(tokens_per_s * 2),
        seconds=2.0,
        ttft_ms=percentiles([5.0, 7.0]),
        itl_ms=percentiles([1.0, 2.0]),
        peak_running=peak_running,
        peak_kv_usage=0.97,
        peak_kv_pool_usage=0.5,
        preemptions=0,
        settings={
            "kv_capacity_tokens": 1024,
            "kv_cache_backend": config,
            "max_batch_size": peak_running,
            "enable_prefix_caching": True,
        },
    )
    return {"kind": "run", **r.to_dict(), "timeline": timeline}


def test_page_and_plots_from_results(tmp_path: Path, report_module) -> None:  # type: ignore[no-untyped-def]
    results, docs = tmp_path / "results", tmp_path / "docs"
    results.mkdir()
    env = describe_environment()
    cap = capacity_table((16, 64), num_rows=2, max_model_len=64, block_size=16, spread=0.0)
    (results / "capacity.json").write_text(json.dumps({"environment": env, **cap}))
    model = {
        "name": "tiny",
        "parameters": 1000,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 4,
        "vocab_size": 10,
    }
    workload = {
        "name": "seed",
        "description": "d",
        "seed": 0,
        "num_requests": 4,
        "prompt_tokens": {"min": 1, "max": 2, "mean": 1.5, "total": 40},
        "max_tokens": {"min": 1, "max": 2, "mean": 1.5, "total": 246},
        "params": {"prompt_scale": 0.5, "new_tokens_scale": 1.0},
        "warmup_requests": 0,
    }
    seed = {
        "environment": env,
        "model": model,
        "workload": workload,
        "kv_budget": {"rows": 2, "max_model_len": 64, "block_size": 16, "tokens": 128},
        "runs": [_run("paged", 123.0, 4), _run("contiguous", 61.5, 2)],
    }
    (results / "seed_embedded.json").write_text(json.dumps(seed))

    page = report_module.write_page(results, docs).read_text()

    assert "123.0" in page and "61.5" in page and "2.00x" in page  # paged / contiguous
    assert "**4** sequences at once (contiguous: **2**)" in page
    assert "**Scaled**: prompt lengths x0.5" in page
    for row in cap["rows"]:
        assert f"| {row['avg_len_target']} |" in page
    for png in ("capacity.png", "kv_usage_timeline.png"):
        assert (docs / "images" / png).stat().st_size > 1000
        assert f"images/{png}" in page
    assert "_Not run yet" in page  # sections without results say so instead of failing
