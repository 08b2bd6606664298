"""``paged-server bench``: workloads through every configuration, one JSON line each.

stdout carries only JSON lines: one ``environment`` line, then per workload
one line per configuration (``kind: run``) and one ``kind: ratios`` line
with paged throughput divided by each other configuration's (same run).
``--capacity`` adds the measured capacity tables as two lines (paged vs
contiguous, and ``kv_cache_dtype`` auto vs fp8 vs int8 at equal KV bytes).
``--kv-cache-dtype`` runs the engine configurations with an 8-bit cache in
the same KV bytes as the model-dtype budget. Progress goes to stderr.

Full workloads are slow on CPU: scale them with ``--num-requests``,
``--max-new-tokens-scale`` and ``--prompt-scale`` (the draws stay the same,
lengths are multiplied), and say which scale you used.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from paged_server.bench.capacity import capacity_table
from paged_server.bench.engine_bench import KVBudget, allow_rows_past_positions
from paged_server.bench.environment import describe_environment
from paged_server.bench.kv_dtype_capacity import kv_dtype_capacity_table
from paged_server.bench.results import RunResult
from paged_server.bench.sliding_window_capacity import sliding_window_capacity_table
from paged_server.bench.suite import ALL_CONFIGS, ModelCache, SuiteOptions, log, ratios, run_suite
from paged_server.bench.workloads import WORKLOADS, make_workload, token_pool_from_tokenizer
from paged_server.config import KV_CACHE_DTYPES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="paged-server bench",
        description="Benchmark the engine (paged vs contiguous KV) against transformers on seeded workloads.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="Hugging Face model directory (default: --model-config)")
    src.add_argument(
        "--model-config",
        choices=("embedded", "trained", "30m", "100m"),
        default="embedded",
        help="embedded: the tiny default model; trained: it after default_model.train's recipe "
        "(trained once, up to ~15 min, and cached); 30m / 100m: a random ~30M / ~100M Llama made once "
        "in the cache dir",
    )
    p.add_argument(
        "--workload",
        action="append",
        choices=sorted(WORKLOADS),
        help="repeatable (default: seed and nano_vllm)",
    )
    p.add_argument("--num-requests", type=int, help="override the workload's request count")
    p.add_argument(
        "--max-new-tokens-scale",
        type=float,
        default=1.0,
        help="multiply every max_tokens (default 1)",
    )
    p.add_argument(
        "--prompt-scale", type=float, default=1.0, help="multiply every prompt length (default 1)"
    )
    p.add_argument(
        "--configs",
        default=",".join(ALL_CONFIGS),
        help=f"comma-separated subset of {','.join(ALL_CONFIGS)}",
    )
    p.add_argument(
        "--kv-rows", type=int, default=8, help="contiguous rows the KV budget equals (default 8)"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        help="every engine's max_model_len = tokens per contiguous row (default 4096)",
    )
    # The two flags' names from before a contiguous row and a token slot got one name each.
    for old, dest in (("--kv-slots", "kv_rows"), ("--kv-slot-len", "max_model_len")):
        p.add_argument(old, dest=dest, type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=256,
        help="paged engine's running-sequence limit (default 256)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--attention-backend", choices=("auto", "ref", "triton"), default="auto")
    p.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto")
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="what the engines' KV cache stores; 8-bit caches get the model-dtype budget's bytes "
        "(so about twice its tokens)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument(
        "--profile-linears",
        action="store_true",
        help="time a compiled CPU engine's linear layers with torch's profiler (its "
        "linear_share then; the profiler slows the run, so its tokens/s are not comparable)",
    )
    p.add_argument("--capacity", action="store_true", help="also print the measured capacity table")
    p.add_argument("--output", help="also append every JSON line to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``paged-server bench`` (and ``python -m paged_server.bench``)."""
    args = build_parser().parse_args(argv)
    with allow_rows_past_positions():
        return _bench(args)


def _bench(args: argparse.Namespace) -> int:
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(ALL_CONFIGS))
    if unknown:
        print(
            f"paged-server bench: unknown --configs {unknown}; choose from {', '.join(ALL_CONFIGS)}",
            file=sys.stderr,
        )
        return 2
    out = open(args.output, "a", encoding="utf-8") if args.output else None  # noqa: SIM115

    def emit(record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True)
        print(line, flush=True)
        if out is not None:
            out.write(line + "\n")
            out.flush()

    try:
        from paged_server.bench.model_configs import resolve_model
        from paged_server.tokenizer import Tokenizer

        model_dir, model_name = resolve_model(args.model, args.model_config)
        options = SuiteOptions(
            budget=KVBudget(args.kv_rows, args.max_model_len, args.block_size),
            paged_max_batch_size=args.max_batch_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            attention_backend=args.attention_backend,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            seed=args.seed,
            profile_linears=args.profile_linears,
        )
        emit({**describe_environment(), "model": model_name, "model_dir": model_dir})
        if args.capacity:
            emit(
                capacity_table(
                    num_rows=args.kv_rows,
                    max_model_len=args.max_model_len,
                    block_size=args.block_size,
                )
            )
            emit(kv_dtype_capacity_table(block_size=args.block_size))
            emit(sliding_window_capacity_table(block_size=args.block_size))
        vocab = json.loads(Path(model_dir, "config.json").read_text(encoding="utf-8")).get(
            "vocab_size"
        )
        pool = token_pool_from_tokenizer(Tokenizer.from_dir(model_dir), vocab)
        models = ModelCache(model_dir, options)
        for name in args.workload or ["seed", "nano_vllm"]:
            workload = make_workload(
                name,
                pool,
                num_requests=args.num_requests,
                seed=args.seed,
                prompt_scale=args.prompt_scale,
                new_tokens_scale=args.max_new_tokens_scale,
            )
            emit({"kind": "workload", **workload.summary()})

            def emit_run(result: RunResult) -> None:
                emit({"kind": "run", **result.to_dict()})

            results = run_suite(
                workload, configs, models, options, model_name=model_name, emit=emit_run
            )
            emit(
                {
                    "kind": "ratios",
                    "workload": workload.name,
                    "model": model_name,
                    **ratios(results),
                }
            )
    except (ValueError, RuntimeError) as exc:
        log(f"error: {exc}")
        return 1
    finally:
        if out is not None:
            out.close()
    return 0
