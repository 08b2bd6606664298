"""One tiny run of every configuration: the JSON lines' schema and the
numbers that must agree between the workload and what was measured."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from paged_server.bench.engine_bench import (
    KVBudget,
    ProfiledLinearTimer,
    allow_rows_past_positions,
    kv_occupancy,
)
from paged_server.bench.results import RESULT_KEYS, percentiles
from paged_server.bench.suite import ALL_CONFIGS


def test_percentiles_nearest_rank() -> None:
    p = percentiles(float(v) for v in range(1, 101))
    assert (p["p50"], p["p90"], p["p99"], p["mean"]) == (50.0, 90.0, 99.0, 50.5)
    assert percentiles([])["p50"] is None


def test_kv_occupancy_reads_both_pool_kinds() -> None:
    paged = {"tokens_used": 40.0, "blocks_used": 3.0, "block_size": 16.0, "num_blocks": 10.0}
    assert kv_occupancy(paged) == (40.0, 48.0, 160.0)
    contiguous = {"tokens_used": 40.0, "rows_used": 2.0, "rows_total": 4.0, "token_capacity": 256.0}
    assert kv_occupancy(contiguous) == (40.0, 128.0, 256.0)


def test_kv_budget_equal_tokens() -> None:
    b = KVBudget(8, 4096, 16)
    assert b.tokens == 32768 and b.num_blocks * b.block_size == b.tokens


def test_budget_rows_pass_the_models_positions_only_inside_the_bench(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The budget's 4,096-slot rows on the embedded model's 2,048 positions:
    allowed within the block, refused again after it (``paged-server bench``
    runs in-process in tests, beside tests that expect the refusal)."""
    from paged_server.config import ALLOW_LONG_MAX_MODEL_LEN_ENV, EngineConfig
    from paged_server.default_model import ensure_default_model
    from paged_server.models.loader import read_model_config

    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, raising=False)
    model = read_model_config(str(ensure_default_model()))
    config = EngineConfig(max_model_len=KVBudget().max_model_len, device="cpu")
    assert model.max_position_embeddings < config.max_model_len
    with pytest.raises(ValueError, match="max_position_embeddings"):
        config.resolve(model)
    with allow_rows_past_positions():
        assert config.resolve(model).max_model_len == config.max_model_len
    assert ALLOW_LONG_MAX_MODEL_LEN_ENV not in os.environ
    with pytest.raises(ValueError, match="max_position_embeddings"):
        config.resolve(model)
    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, "0")  # a caller's own value comes back
    with allow_rows_past_positions():
        pass
    assert os.environ[ALLOW_LONG_MAX_MODEL_LEN_ENV] == "0"


def test_cli_prints_one_json_line_per_configuration(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from paged_server.bench import main

    rc = main(
        [
            "--model",
            str(tiny_model_dir),
            "--workload",
            "seed",
            "--num-requests",
            "4",
            "--prompt-scale",
            "0.1",
            "--max-new-tokens-scale",
            "0.05",
            "--kv-rows",
            "2",
            "--max-model-len",
            "128",
            "--max-batch-size",
            "8",
            "--max-num-batched-tokens",
            "64",
            "--attention-backend",
            "ref",
            "--dtype",
            "float32",
        ]
    )
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    kinds = [x["kind"] for x in lines]
    assert kinds == ["environment", "workload", "run", "run", "run", "run", "ratios"]
    workload = lines[1]
    runs = {x["config"]: x for x in lines if x["kind"] == "run"}
    assert set(runs) == set(ALL_CONFIGS)
    for run in runs.values():
        assert set(RESULT_KEYS) <= set(run), set(RESULT_KEYS) - set(run)
        assert run["output_tokens"] == workload["max_tokens"]["total"]
        assert run["tokens_per_s"] == pytest.approx(run["output_tokens"] / run["seconds"], rel=0.02)
        assert run["ttft_ms"]["p50"] is not None and run["ttft_ms"]["p50"] > 0
    paged, contiguous = runs["paged"], runs["contiguous"]
    # Same KV bytes; the contiguous pool runs at most its 2 rows at once.
    assert paged["settings"]["kv_bytes"] == contiguous["settings"]["kv_bytes"]
    assert contiguous["peak_running"] <= 2 < paged["peak_running"] <= 4
    assert 0 < contiguous["peak_kv_usage"] < paged["peak_kv_usage"] <= 1
    assert paged["preemptions"] == 0
    # Our engine times its linear layers (the CPU bound); transformers' runs do not.
    for ours in (paged, contiguous):
        assert 0 < ours["linear_seconds"] < ours["seconds"]
        assert 0 < ours["linear_share"] < 1
    assert runs["hf_generate_batch"]["linear_seconds"] is None
    ratios = lines[-1]
    assert ratios["paged_vs_contiguous"] == pytest.approx(
        paged["tokens_per_s"] / contiguous["tokens_per_s"], rel=0.02
    )


@pytest.mark.parametrize("caching", [False, True])
def test_prefix_cache_run_reports_hits_only_with_caching(
    tiny_model_dir: Path, caching: bool
) -> None:
    from paged_server.bench.suite import ModelCache, SuiteOptions, run_config
    from paged_server.bench.workloads import shared_prefix_workload

    options = SuiteOptions(
        budget=KVBudget(2, 256, 16),
        paged_max_batch_size=8,
        max_num_batched_tokens=128,
        attention_backend="ref",
        dtype="float32",
    )
    workload = shared_prefix_workload(
        list(range(3, 4000)),
        num_requests=4,
        system_prompt_tokens=64,
        suffix_range=(4, 8),
        new_tokens_range=(2, 3),
    )
    result = run_config(
        "paged",
        workload,
        ModelCache(str(tiny_model_dir), options),
        options,
        model_name="tiny",
        enable_prefix_caching=caching,
    )
    assert result.output_tokens == workload.output_tokens
    if caching:
        # every burst request finds the warm-up's 64 system-prompt tokens (4 full blocks)
        assert result.prefix_cache_hit_rate is not None
        assert result.prefix_cache_hit_rate >= 0.8 * 64 / 72
    else:
        assert not result.prefix_cache_hit_rate


def test_physical_tokens_count_shared_blocks_once() -> None:
    from paged_core.block_manager import BlockManager
    from paged_server.bench.engine_bench import physical_tokens_held

    bm = BlockManager(num_blocks=8, block_size=16, enable_prefix_caching=False)
    bm.allocate(0, list(range(40)))  # blocks of 16, 16, 8 tokens
    assert physical_tokens_held(bm) == 40
    bm.fork(0, 1)  # same three blocks, now shared
    assert bm.stats().tokens_used == 80  # logical: once per sequence
    assert physical_tokens_held(bm) == 40
    bm.allocate(2, list(range(5)))
    assert physical_tokens_held(bm) == 45


def test_profiled_linear_timer_counts_gemms_only() -> None:
    """The compiled engines' timer: a matmul's time counts, an elementwise
    op's does not."""
    x = torch.randn(256, 512)
    with ProfiledLinearTimer() as gemm:
        start = time.perf_counter()
        for _ in range(5):
            torch.mm(x, x.T)
        wall = time.perf_counter() - start
    with ProfiledLinearTimer() as other:
        for _ in range(5):
            torch.exp(x).sum()
    assert 0 < gemm.seconds <= wall * 1.05
    assert other.seconds == 0.0
