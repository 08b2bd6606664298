"""Run every engine benchmark, write JSON results, plots and docs/benchmarks.md.

``nox -s bench`` runs this after the kernel microbenchmarks. Sized for a
2-core CPU machine (about 10 minutes with the microbenchmarks, well under
20): the seed workload at full size on the embedded tiny model, the seed
workload with scaled-down lengths on the ~100M random Llama, a scaled-down
nano-vllm run, a batch-size sweep on the ~100M model, the
shared-system-prompt run with and without prefix caching, and the measured
capacity table. Every JSON line it measures is printed as it is measured, and
the page is rendered from the JSON files only, so the page shows exactly the
numbers printed.

    python benchmarks/run_all.py            # everything (2-core CPU: ~8 min)
    python benchmarks/run_all.py --quick    # tiny sizes, a smoke test (~1-2 min)
    python benchmarks/run_all.py --page-only  # re-render the page and plots from results/
    python benchmarks/run_all.py --only llamacpp_peer  # opt-in: paged vs llama.cpp (needs its build)
    python benchmarks/run_all.py --only llamacpp_quantized  # opt-in: int8/int4 vs llama.cpp Q8_0/Q4_0
    python benchmarks/run_all.py --only kv_accuracy_trained  # opt-in: int4/8-bit KV on the trained model
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from report import write_page  # benchmarks/report.py: this script's folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"

# What runs, and at what size. Scales multiply the workload's own draws
# (see paged_server.bench.workloads); every scale used is recorded in the JSON.
FULL_PLAN: dict[str, Any] = {
    "seed_embedded": {
        "model": "embedded",
        "workload": "seed",
        "num_requests": None,
        "prompt_scale": 1.0,
        "new_tokens_scale": 1.0,
    },
    "seed_100m": {
        "model": "100m",
        "workload": "seed",
        "num_requests": None,
        "prompt_scale": 0.5,
        "new_tokens_scale": 0.25,
    },
    "seed_100m_full": {  # `paged-server bench --model-config 100m --workload seed`
        "model": "100m",
        "workload": "seed",
        "num_requests": None,
        "prompt_scale": 1.0,
        "new_tokens_scale": 1.0,
        "configs": ["paged", "hf_generate_batch", "hf_static_generate"],
    },
    "nano_vllm_embedded": {
        "model": "embedded",
        "workload": "nano_vllm",
        "num_requests": 64,
        "prompt_scale": 0.5,
        "new_tokens_scale": 0.25,
    },
    "batch_sweep": {
        "model": "100m",
        "workload": "seed",
        "num_requests": None,
        "prompt_scale": 0.25,
        "new_tokens_scale": 0.25,
        "batch_sizes": [4, 8, 16, 32, 48],
    },
    "serving_latency": {  # bench-serve, Poisson arrivals keeping ~32 sequences running
        "model": "embedded",
        "workload": "continuous_batching",
        "num_requests": 96,
        "request_rate": 8.0,
        "budgets": [2048, None],  # None: the engine's CPU default
    },
    "tensor_parallel": {  # paged engine, TP=1 vs TP=2 (gloo on CPU)
        "model": "100m",
        "workload": "seed",
        "num_requests": None,
        "prompt_scale": 0.25,
        "new_tokens_scale": 0.25,
    },
    "prefix_cache": {
        "model": "embedded",
        "workload": "shared_prefix",
        "num_requests": 32,
        "prompt_scale": 1.0,
        "new_tokens_scale": 1.0,
    },
    "kv_dtype": {  # correctness: capacity at equal bytes + accuracy; no timing
        "models": ["embedded", "100m"],
        "num_prompts": 8,
        "max_tokens": 64,
    },
    "kv_dtype_throughput": {  # the seed workload, paged, per kv_cache_dtype, equal KV bytes
        "model": "embedded",
        "workload": "seed",
        "num_requests": None,
        "prompt_scale": 1.0,
        "new_tokens_scale": 1.0,
        "kv_cache_dtypes": ["auto", "fp8", "int8"],
    },
    # opt-in (--only kv_accuracy_trained): the first run trains the evaluation model (~15 min
    # on 2 cores, cached), then ~10 min of perplexity and 64 x 64 greedy tokens per row.
    "kv_accuracy_trained": {
        "model": "trained", "num_prompts": 64, "max_tokens": 64, "text_tokens": None,
        "int4_block_sizes": [16, 64],
    },  # fmt: skip
    "llamacpp_peer": {  # opt-in (--only llamacpp_peer): ~30 min, needs a llama.cpp build
        "model": "30m",
        "outtypes": ["f32", "f16"],
        "concurrency": [1, 8, 16, 32],
        "repeats": 2,
        "num_requests": 64,
        "single_stream_requests": 8,
    },
    "llamacpp_quantized": {  # opt-in: paged int8/int4 vs Q8_0/Q4_0 (issue 30), ~25 min, needs the build
        "model": "100m",
        "pairs": "int8=q8_0,int4=q4_0",
        "concurrency": [1, 8],
        "repeats": 2,
        "num_requests": 64,
        "single_stream_requests": 8,
    },
}
QUICK_PLAN: dict[str, Any] = {
    "seed_embedded": {
        "model": "embedded",
        "workload": "seed",
        "num_requests": 12,
        "prompt_scale": 0.25,
        "new_tokens_scale": 0.1,
    },
    "seed_100m": {
        "model": "100m",
        "workload": "seed",
        "num_requests": 4,
        "prompt_scale": 0.1,
        "new_tokens_scale": 0.05,
    },
    "seed_100m_full": {
        "model": "embedded",
        "workload": "seed",
        "num_requests": 4,
        "prompt_scale": 0.1,
        "new_tokens_scale": 0.05,
        "configs": ["paged", "hf_generate_batch", "hf_static_generate"],
    },
    "nano_vllm_embedded": {
        "model": "embedded",
        "workload": "nano_vllm",
        "num_requests": 8,
        "prompt_scale": 0.1,
        "new_tokens_scale": 0.05,
    },
    "serving_latency": {
        "model": "embedded",
        "workload": "continuous_batching",
        "num_requests": 8,
        "request_rate": 8.0,
        "budgets": [2048, None],
    },
    "batch_sweep": {
        "model": "embedded",
        "workload": "seed",
        "num_requests": 12,
        "prompt_scale": 0.25,
        "new_tokens_scale": 0.05,
        "batch_sizes": [2, 4, 8, 12],
    },
    "tensor_parallel": {
        "model": "embedded",
        "workload": "seed",
        "num_requests": 8,
        "prompt_scale": 0.1,
        "new_tokens_scale": 0.05,
    },
    "prefix_cache": {
        "model": "embedded",
        "workload": "shared_prefix",
        "num_requests": 8,
        "prompt_scale": 0.5,
        "new_tokens_scale": 0.5,
    },
    "kv_dtype": {"models": ["embedded"], "num_prompts": 2, "max_tokens": 8},
    "kv_dtype_throughput": {
        "model": "embedded",
        "workload": "seed",
        "num_requests": 4,
        "prompt_scale": 0.1,
        "new_tokens_scale": 0.05,
        "kv_cache_dtypes": ["auto", "int8"],
    },
    "kv_accuracy_trained": {  # the embedded (random) model stands in: no training in a smoke run
        "model": "embedded", "num_prompts": 2, "max_tokens": 4, "text_tokens": 256,
        "int4_block_sizes": [16],
    },  # fmt: skip
    "llamacpp_peer": {
        "model": "embedded",
        "outtypes": ["f32"],
        "concurrency": [2],
        "repeats": 1,
        "num_requests": 4,
        "single_stream_requests": 2,
    },
    "llamacpp_quantized": {
        "model": "embedded",
        "pairs": "int8=q8_0",
        "concurrency": [2],
        "repeats": 1,
        "num_requests": 4,
        "single_stream_requests": 2,
    },
}
# Steps a plain run leaves out: run them with --only.
OPT_IN = ("llamacpp_peer", "llamacpp_quantized", "kv_accuracy_trained")


def emit(record: dict[str, Any]) -> None:
    """Print one JSON line (the numbers the page will show)."""
    print(json.dumps(record, sort_keys=True), flush=True)


def save(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def run_line(result: Any, *, timeline: bool = False) -> dict[str, Any]:
    record = {"kind": "run", **result.to_dict()}
    emit(record)
    if timeline:
        record["timeline"] = result.timeline
    return record


class Bench:
    """Shared state of one run_all invocation: environment, models, token pools."""

    def __init__(self, plan: dict[str, Any]) -> None:
        from paged_server.bench.environment import describe_environment
        from paged_server.bench.suite import SuiteOptions

        self.plan = plan
        self.env = describe_environment()
        self.options = SuiteOptions()
        self._models: dict[str, Any] = {}
        emit(self.env)

    def model(self, key: str) -> tuple[Any, str, list[int]]:
        """(ModelCache, display name, token pool) for ``embedded`` or ``100m``."""
        if key not in self._models:
            from paged_server.bench.model_configs import count_parameters, resolve_model
            from paged_server.bench.suite import ModelCache
            from paged_server.bench.workloads import token_pool_from_tokenizer
            from paged_server.tokenizer import Tokenizer

            model_dir, name = resolve_model(None, key)
            config = json.loads(Path(model_dir, "config.json").read_text(encoding="utf-8"))
            pool = token_pool_from_tokenizer(Tokenizer.from_dir(model_dir), config["vocab_size"])
            info = {
                "name": name,
                "parameters": count_parameters(model_dir),
                "config": config,
            }
            self._models[key] = (ModelCache(model_dir, self.options), name, pool, info)
        models, name, pool, _ = self._models[key]
        return models, name, pool

    def model_info(self, key: str) -> dict[str, Any]:
        self.model(key)
        info = self._models[key][3]
        c = info["config"]
        keys = (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
        )
        return {
            "name": info["name"],
            "parameters": info["parameters"],
            **{k: c.get(k) for k in keys},
        }

    def workload(self, spec: dict[str, Any]) -> Any:
        from paged_server.bench.workloads import make_workload

        _, _, pool = self.model(spec["model"])
        return make_workload(
            spec["workload"],
            pool,
            num_requests=spec["num_requests"],
            prompt_scale=spec["prompt_scale"],
            new_tokens_scale=spec["new_tokens_scale"],
        )

    def header(self, spec: dict[str, Any], workload: Any) -> dict[str, Any]:
        summary = workload.summary()
        emit({"kind": "workload", **summary})
        return {
            "environment": self.env,
            "model": self.model_info(spec["model"]),
            "workload": summary,
            "plan": spec,
            "kv_budget": {
                "rows": self.options.budget.rows,
                "max_model_len": self.options.budget.max_model_len,
                "block_size": self.options.budget.block_size,
                "tokens": self.options.budget.tokens,
            },
        }


def run_comparison(bench: Bench, key: str, *, timelines: bool = False) -> dict[str, Any]:
    """The plan's configurations (default: all four) on one workload, side by side."""
    from paged_server.bench.suite import ALL_CONFIGS, ratios, run_config

    spec = bench.plan[key]
    models, name, _ = bench.model(spec["model"])
    workload = bench.workload(spec)
    data = bench.header(spec, workload)
    results = []
    for config in spec.get("configs", ALL_CONFIGS):
        results.append(run_config(config, workload, models, bench.options, model_name=name))
    data["runs"] = [
        run_line(r, timeline=timelines and r.config in ("paged", "contiguous")) for r in results
    ]
    data["ratios"] = ratios(results)
    emit({"kind": "ratios", "workload": workload.name, "model": name, **data["ratios"]})
    save(key, data)
    return data


def run_batch_sweep(bench: Bench) -> dict[str, Any]:
    """Both engine backends at several max_batch_size values, same workload."""
    from paged_server.bench.suite import run_config

    spec = bench.plan["batch_sweep"]
    models, name, _ = bench.model(spec["model"])
    workload = bench.workload(spec)
    data = bench.header(spec, workload)
    runs = []
    for batch in spec["batch_sizes"]:
        for backend in ("paged", "contiguous"):
            r = run_config(
                backend,
                workload,
                models,
                bench.options,
                model_name=name,
                max_batch_size=batch,
                label=f"{backend}@{batch}",
            )
            runs.append(run_line(r))
    data["runs"] = runs
    save("batch_sweep", data)
    return data


def run_prefix_cache(bench: Bench) -> dict[str, Any]:
    """Paged engine on the shared-system-prompt workload, caching off then on."""
    from paged_server.bench.suite import run_config

    spec = bench.plan["prefix_cache"]
    models, name, _ = bench.model(spec["model"])
    workload = bench.workload(spec)
    data = bench.header(spec, workload)
    runs = []
    for enabled in (False, True):
        r = run_config(
            "paged",
            workload,
            models,
            bench.options,
            model_name=name,
            enable_prefix_caching=enabled,
            label=f"paged, prefix caching {'on' if enabled else 'off'}",
        )
        runs.append(run_line(r))
    data["runs"] = runs
    save("prefix_cache", data)
    return data


def run_serving_latency(bench: Bench) -> dict[str, Any]:
    """``paged-server bench-serve``, once per step token budget, each in a
    process of its own: inter-token latency of ~32 running streams while
    prompts keep arriving. In this process the steps before it have started
    torch's thread pool on the main thread; a server here would step beside
    it, and with more OpenMP threads than cores libgomp stops spinning (run
    after the offline steps: ITL p50 10.3-10.6 ms against 4.1-4.4 alone)."""
    spec = bench.plan["serving_latency"]
    bench.model(spec["model"])  # the embedded model exists before the server starts
    runs = []
    for budget in spec["budgets"]:
        argv = [
            "bench-serve",
            "--workload", spec["workload"],
            "--num-requests", str(spec["num_requests"]),
            "--request-rate", str(spec["request_rate"]),
            "--max-num-batched-tokens", "none" if budget is None else str(budget),
        ]  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "paged_server.entrypoints.cli", *argv],
            stdout=subprocess.PIPE, text=True, check=True,
        )  # fmt: skip
        report = json.loads(done.stdout.strip().splitlines()[-1])  # its one JSON line
        report["budget"] = report["engine_config"]["max_num_batched_tokens"]
        report["budget_is_default"] = budget is None
        emit({"kind": "serve", **report})
        runs.append(report)
    data = {"environment": bench.env, "plan": spec, "runs": runs}
    save("serving_latency", data)
    return data


def run_tensor_parallel(bench: Bench) -> dict[str, Any]:
    """The paged engine with tensor_parallel_size 1 then 2 on one workload
    (CPU: two gloo ranks sharing the machine's cores), with each rank's
    collectives per step counted."""
    import dataclasses

    from paged_server.bench.engine_bench import engine_config, run_engine
    from paged_server.engine.core.llm_engine import LLMEngine

    spec = bench.plan["tensor_parallel"]
    models, name, _ = bench.model(spec["model"])
    workload = bench.workload(spec)
    data = bench.header(spec, workload)
    base = engine_config(
        "paged", bench.options.budget, model=models.model_dir,
        max_num_batched_tokens=bench.options.max_num_batched_tokens,
        attention_backend=bench.options.attention_backend, dtype=bench.options.dtype,
    )  # fmt: skip
    runs, comms = [], {}
    for tp in (1, 2):
        engine = LLMEngine(dataclasses.replace(base, tensor_parallel_size=tp))
        try:
            result = run_engine(engine, workload, config_name=f"paged_tp{tp}", model_name=name)
            if engine.executor is not None and engine.executor.group is not None:
                counts = engine.executor.group.counts
                steps = result.settings["steps"]
                comms = {
                    "all_reduces_per_step": counts.all_reduces / max(counts.messages, 1),
                    "broadcasts_per_message": counts.broadcasts / max(counts.messages, 1),
                    "messages": counts.messages,
                    "measured_steps": steps,
                }
        finally:
            engine.shutdown()
        runs.append(run_line(result))
    data["runs"] = runs
    data["communication"] = comms
    t1, t2 = (r["tokens_per_s"] for r in runs)
    data["ratios"] = {"tp2_vs_tp1": t2 / t1 if t1 else None}
    emit({"kind": "ratios", "workload": workload.name, "model": name, **data["ratios"], **comms})
    save("tensor_parallel", data)
    return data


def run_capacity(bench: Bench) -> dict[str, Any]:
    from paged_server.bench.capacity import capacity_table

    b = bench.options.budget
    table = capacity_table(num_rows=b.rows, max_model_len=b.max_model_len, block_size=b.block_size)
    emit(table)
    save("capacity", {"environment": bench.env, **table})
    return table


def run_sliding_window(bench: Bench) -> dict[str, Any]:
    """Hybrid KV cache groups, correctness only: blocks a Gemma 3 1B-shaped
    sequence holds at 1k-8k tokens, and sequences that fit 1 GiB, hybrid vs
    one group (meta-device pools)."""
    from paged_server.bench.sliding_window_capacity import sliding_window_capacity_table

    table = sliding_window_capacity_table(block_size=bench.options.budget.block_size)
    emit(table)
    save("sliding_window", {"environment": bench.env, **table})
    return table


def run_kv_dtype(bench: Bench) -> dict[str, Any]:
    """8-bit KV caches, correctness only: tokens and sequences at equal KV
    bytes per kv_cache_dtype, and the accuracy table on each test model."""
    from kv_accuracy import kv_accuracy_table
    from paged_server.bench.kv_dtype_capacity import kv_dtype_capacity_table
    from paged_server.models import load_model

    spec = bench.plan["kv_dtype"]
    capacity = kv_dtype_capacity_table(block_size=bench.options.budget.block_size)
    emit(capacity)
    accuracy = []
    for key in spec["models"]:
        models, name, _ = bench.model(key)
        loaded = load_model(models.model_dir, "float32", "cpu")
        table = kv_accuracy_table(loaded, name, num_prompts=spec["num_prompts"],
                                  max_tokens=spec["max_tokens"])  # fmt: skip
        emit(table)
        accuracy.append(table)
    data = {"environment": bench.env, "capacity": capacity, "accuracy": accuracy, "plan": spec}
    save("kv_dtype", data)
    return data


def run_kv_accuracy_trained(bench: Bench) -> dict[str, Any]:
    """int4 / int8 / fp8 KV against the model dtype on the trained evaluation
    model's held-out text: perplexity (int4 target: within 5%) and greedy
    agreement over 64 prompts x 64 tokens."""
    from kv_accuracy import trained_kv_accuracy_table
    from paged_server.models import load_model

    spec = bench.plan["kv_accuracy_trained"]
    models, name, _ = bench.model(spec["model"])
    loaded = load_model(models.model_dir, "float32", "cpu")
    table = trained_kv_accuracy_table(
        loaded, name, num_prompts=spec["num_prompts"], max_tokens=spec["max_tokens"],
        text_tokens=spec["text_tokens"], int4_block_sizes=tuple(spec["int4_block_sizes"]),
    )  # fmt: skip
    emit(table)
    training = Path(models.model_dir, "training.json")
    data = {"environment": bench.env, **table, "plan": spec,
            "training": json.loads(training.read_text()) if training.is_file() else None}  # fmt: skip
    save("kv_accuracy_trained", data)
    return data


def run_kv_dtype_throughput(bench: Bench) -> dict[str, Any]:
    """The paged engine on the seed workload with each kv_cache_dtype, every
    one in the KV bytes of the model-dtype budget (so 8 bits get ~2x tokens)."""
    import dataclasses

    from paged_server.bench.suite import run_config

    spec = bench.plan["kv_dtype_throughput"]
    models, name, _ = bench.model(spec["model"])
    workload = bench.workload(spec)
    data = bench.header(spec, workload)
    runs = []
    for kv in spec["kv_cache_dtypes"]:
        options = dataclasses.replace(bench.options, kv_cache_dtype=kv)
        result = run_config("paged", workload, models, options, model_name=name,
                            label=f"paged, kv_cache_dtype={kv}")  # fmt: skip
        runs.append({**run_line(result), "kv_cache_dtype": kv})
    base = runs[0]["tokens_per_s"]
    for run in runs:
        run["vs_auto"] = round(run["tokens_per_s"] / base, 3) if base else None
    data["runs"] = runs
    save("kv_dtype_throughput", data)
    return data


def run_llamacpp_peer(bench: Bench, key: str = "llamacpp_peer") -> dict[str, Any]:
    """paged-server against llama.cpp's llama-server (benchmarks/llamacpp_peer.py;
    ``llamacpp_quantized``: its ``--quantized`` pairs); skipped with a message
    when llama.cpp is not built."""
    import llamacpp_peer

    spec = bench.plan[key]
    kind = ["--quantized", spec["pairs"]] if "pairs" in spec else ["--outtypes", ",".join(spec["outtypes"])]
    argv = [
        "--model-config", spec["model"], *kind,
        "--concurrency", ",".join(map(str, spec["concurrency"])), "--repeats", str(spec["repeats"]),
        "--num-requests", str(spec["num_requests"]),
        "--single-stream-requests", str(spec["single_stream_requests"]),
        "--out", str(RESULTS), "--no-page",
    ]  # fmt: skip
    llamacpp_peer.main(argv)
    name = llamacpp_peer.QUANTIZED_RESULTS_NAME if "pairs" in spec else llamacpp_peer.RESULTS_NAME
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def append_history(results: dict[str, dict[str, Any]], env: dict[str, Any]) -> None:
    """One line per configuration and date in results/history.jsonl (the
    SERVING_LOG the page's history table is built from)."""
    lines = []
    for key, data in results.items():
        for run in data.get("runs", []):
            lines.append(
                {
                    "date": env["date"],
                    "hardware": env["hardware"],
                    "benchmark": key,
                    "model": data["model"]["name"],
                    "workload": data["workload"]["name"],
                    "num_requests": data["workload"]["num_requests"],
                    "config": run["config"],
                    "tokens_per_s": run["tokens_per_s"],
                    "ttft_p50_ms": run["ttft_ms"]["p50"],
                    "itl_p50_ms": run["itl_ms"]["p50"],
                    "peak_running": run["peak_running"],
                    "peak_kv_usage": run["peak_kv_usage"],
                    "preemptions": run["preemptions"],
                }
            )
    with open(RESULTS / "history.jsonl", "a", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes (smoke test); results are not kept in history",
    )
    parser.add_argument(
        "--page-only",
        action="store_true",
        help="only re-render docs/benchmarks.md and plots from results/",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="write results/ and the page under this folder instead of the repo "
        "(default for --quick: a temporary folder, so smoke runs never overwrite real results)",
    )
    parser.add_argument(
        "--only",
        help="comma-separated subset: capacity,seed_embedded,seed_100m,seed_100m_full,"
        "nano_vllm_embedded,batch_sweep,prefix_cache,serving_latency,tensor_parallel,kv_dtype,"
        "kv_dtype_throughput; opt-in, only when named: llamacpp_peer, llamacpp_quantized, kv_accuracy_trained",
    )
    args = parser.parse_args(argv)
    global RESULTS, DOCS
    out = args.out
    if out is None and args.quick:
        import tempfile

        out = Path(tempfile.mkdtemp(prefix="paged-bench-quick-"))
    if out is not None:
        RESULTS, DOCS = out / "results", out / "docs"
        if args.page_only and (ROOT / "benchmarks" / "results").is_dir() and not RESULTS.exists():
            RESULTS = ROOT / "benchmarks" / "results"
    if not args.page_only:
        started = time.perf_counter()
        from paged_server.bench.engine_bench import allow_rows_past_positions

        # the 8 x 4,096-slot budget on the embedded model's 2,048 positions
        with allow_rows_past_positions():
            bench = Bench(QUICK_PLAN if args.quick else FULL_PLAN)
            steps = {
                "capacity": lambda: run_capacity(bench),
                "seed_embedded": lambda: run_comparison(bench, "seed_embedded", timelines=True),
                "seed_100m": lambda: run_comparison(bench, "seed_100m"),
                "seed_100m_full": lambda: run_comparison(bench, "seed_100m_full"),
                "nano_vllm_embedded": lambda: run_comparison(bench, "nano_vllm_embedded"),
                "batch_sweep": lambda: run_batch_sweep(bench),
                "prefix_cache": lambda: run_prefix_cache(bench),
                "serving_latency": lambda: run_serving_latency(bench),
                "tensor_parallel": lambda: run_tensor_parallel(bench),
                "kv_dtype": lambda: run_kv_dtype(bench),
                "sliding_window": lambda: run_sliding_window(bench),
                "kv_dtype_throughput": lambda: run_kv_dtype_throughput(bench),
                "llamacpp_peer": lambda: run_llamacpp_peer(bench),
                "llamacpp_quantized": lambda: run_llamacpp_peer(bench, "llamacpp_quantized"),
                "kv_accuracy_trained": lambda: run_kv_accuracy_trained(bench),
            }
            only = [s.strip() for s in args.only.split(",")] if args.only else [s for s in steps if s not in OPT_IN]
            unknown = set(only) - set(steps)
            if unknown:
                parser.error(f"unknown --only steps {sorted(unknown)}; choose from {', '.join(steps)}")
            done: dict[str, dict[str, Any]] = {}
            durations: dict[str, float] = {}
            for name in only:
                t0 = time.perf_counter()
                done[name] = steps[name]()
                durations[name] = round(time.perf_counter() - t0, 1)
                print(f"[run_all] {name}: {durations[name]} s", file=sys.stderr, flush=True)
            total = round(time.perf_counter() - started, 1)
            if not args.quick and not args.only:
                append_history(
                    {
                        k: v
                        for k, v in done.items()
                        if k
                        not in (
                            "capacity", "serving_latency", "tensor_parallel", "kv_dtype",
                            "kv_dtype_throughput", "sliding_window", "llamacpp_peer",
                            "llamacpp_quantized", "kv_accuracy_trained",
                        )  # fmt: skip
                    },
                    bench.env,
                )
                save(
                    "run_info",
                    {"date": bench.env["date"], "seconds": durations, "total_seconds": total},
                )
        print(f"[run_all] total {total} s", file=sys.stderr, flush=True)
    page = write_page(RESULTS, DOCS)
    print(f"[run_all] wrote {page}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
