"""The kv_cache_dtype benchmarks: capacity at equal KV bytes (2x at 8 bits,
4x against float32, int8 a little less for its per-token scales, exactly 2x
with calculate_kv_scales), engines run in the same bytes, and the accuracy
table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kv_accuracy import compare, kv_accuracy_table
from paged_server.bench.kv_dtype_capacity import KVLayout, kv_dtype_capacity_table


def test_capacity_at_equal_bytes_doubles_at_8_bits() -> None:
    layout = KVLayout("test", num_layers=2, num_kv_heads=2, head_dim=64)
    table = kv_dtype_capacity_table(budget_bytes=4 << 20, avg_len=100, layout=layout)
    rows = {
        (r["model_dtype"], r["kv_cache_dtype"], r["calculate_kv_scales"]): r for r in table["rows"]
    }
    assert {(kv, calc) for _, kv, calc in rows} == {
        ("auto", False), ("fp8", False), ("fp8_e5m2", False), ("int8", False), ("int8", True),
        ("fp8", True), ("int4", False),
    }  # fmt: skip
    for (model_dtype, kv, calc), r in rows.items():
        assert r["kv_bytes"] <= 4 << 20
        assert r["sequences"] == r["num_blocks"] // 7  # 100 tokens take 7 blocks of 16
        # int4 at block 16: 64 B of codes + 16 of key and 4 of value scales per head (K+V)
        want = {"auto": 1.0, "fp8": 2.0, "fp8_e5m2": 2.0, "int8": 2.0 if calc else 2 * 64 / 66,
                "int4": 256 / 84}[kv]  # fmt: skip
        if model_dtype == "float32" and kv != "auto":
            want *= 2
        assert r["tokens_vs_auto"] == pytest.approx(want, rel=3e-3), (model_dtype, kv)  # whole blocks
    assert rows[("bfloat16", "int8", False)]["bytes_per_token"] == 2 * 2 * 2 * (64 + 2)
    # Calculated scales: no per-token scale bytes, exactly half a 16-bit cache.
    static = rows[("bfloat16", "int8", True)]
    assert static["bytes_per_token"] == 2 * 2 * 2 * 64
    assert static["tokens_vs_auto"] == 2.0


def test_compare_counts_agreement_up_to_the_first_difference() -> None:
    base = [([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4]), ([5, 6], [-1.0, -1.0])]
    runs = [([1, 2, 9, 4], [-0.1, -0.25, -3.0, -0.4]), ([5, 6], [-1.0, -1.001])]
    agreement, delta = compare(runs, base)
    assert agreement == pytest.approx((2 / 4 + 1) / 2)
    assert delta == pytest.approx(0.05)  # position 2 (different token) is not compared


def test_accuracy_table_on_a_tiny_model(tiny_model_dir: Path) -> None:
    import torch

    from paged_server.models import load_model

    loaded = load_model(tiny_model_dir, torch.float32, "cpu")
    table = kv_accuracy_table(loaded, "tiny", num_prompts=2, prompt_len=8, max_tokens=4,
                               text_chars=600)  # fmt: skip
    rows = {
        r["kv_cache_dtype"] + ("+calc" if r["calculate_kv_scales"] else ""): r for r in table["rows"]
    }
    assert set(rows) == {"auto", "fp8", "fp8_e5m2", "int8", "int8+calc", "fp8+calc", "int4"}
    assert rows["auto"]["greedy_agreement"] == 1.0 and rows["auto"]["max_abs_delta_logprob"] == 0
    for r in rows.values():
        assert 0 <= r["greedy_agreement"] <= 1 and math.isfinite(r["perplexity"])
        assert r["perplexity"] == pytest.approx(rows["auto"]["perplexity"], rel=0.05)
    assert rows["int8"]["perplexity"] != rows["auto"]["perplexity"]  # the cache is quantized
    assert rows["int8+calc"]["perplexity"] != rows["int8"]["perplexity"]  # another scheme ran


def test_bench_cli_runs_engines_in_the_same_kv_bytes(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from paged_server.bench import main

    runs = {}
    for kv in ("auto", "int8"):
        rc = main([
            "--model", str(tiny_model_dir), "--workload", "seed", "--num-requests", "2",
            "--prompt-scale", "0.05", "--max-new-tokens-scale", "0.02", "--kv-rows", "2",
            "--max-model-len", "128", "--configs", "paged,contiguous", "--attention-backend", "ref",
            "--dtype", "float32", "--kv-cache-dtype", kv,
        ])  # fmt: skip
        assert rc == 0
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        runs[kv] = {x["config"]: x for x in lines if x["kind"] == "run"}
    for config in ("paged", "contiguous"):
        auto, int8 = runs["auto"][config]["settings"], runs["int8"][config]["settings"]
        assert int8["kv_bytes"] <= auto["kv_bytes"]
        # float32 model, head_dim 8: int8 + an fp16 scale = 10 bytes per 32.
        assert int8["kv_bytes"] >= 0.9 * auto["kv_bytes"]
