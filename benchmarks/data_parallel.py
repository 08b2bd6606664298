"""Serving throughput and prefix hit rate at --data-parallel-size 1 vs 2, side by side.

    python benchmarks/data_parallel.py [--model DIR] [--num-requests 64] [--max-concurrency 32]

Runs ``paged-server bench-serve`` twice in one process on the same seeded
workload (``prefix_groups``: four system prompts taking turns, so prefix
locality across replicas matters; one burst, at most ``--max-concurrency``
requests in flight), first with one engine, then with two replicas behind
one server, and prints both JSON reports and one line of ratios: output
tokens/s DP=2 over DP=1, and each run's prefix-cache hit rate and requests
routed by prefix. On CPU the replicas share the machine's cores (each gets
cores / 2 torch threads), so the ratio says what the cores allow, not what
two GPUs would. Extra flags go to bench-serve (engine flags included).
"""

from __future__ import annotations

import argparse
import json
import sys

from paged_server.bench.serving import bench_serve
from paged_server.entrypoints.cli import build_parser
from paged_server.entrypoints.openai.engine_args import engine_config_from_args


def run(dp: int, extra: list[str]) -> dict:
    args = build_parser().parse_args(["bench-serve", "--data-parallel-size", str(dp), *extra])
    return bench_serve(args, engine_config_from_args(args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--workload", default="prefix_groups")
    ours, extra = parser.parse_known_args()
    extra = ["--workload", ours.workload, "--request-rate", "inf", "--num-requests", str(ours.num_requests),
             "--max-concurrency", str(ours.max_concurrency), *extra]  # fmt: skip
    reports = {dp: run(dp, extra) for dp in (1, 2)}
    for dp, report in reports.items():
        print(json.dumps({"data_parallel_size": dp, **report}, default=str), flush=True)
    one, two = reports[1], reports[2]
    ratio = (two["output_tokens_per_s"] or 0) / (one["output_tokens_per_s"] or 1)
    print(
        f"DP=2 / DP=1 output tok/s: {ratio:.2f}x ({two['output_tokens_per_s']} vs {one['output_tokens_per_s']}) "
        f"at max concurrency {ours.max_concurrency}; prefix hit rate DP=1 {one['server']['prefix_cache_hit_rate']}, "
        f"DP=2 {two['server']['prefix_cache_hit_rate']} "
        f"({two['server']['dp_requests_routed_by_prefix_total']:.0f} requests routed by prefix)",
        flush=True,
    )
    sys.exit(0 if one["failed"] == two["failed"] == 0 else 1)


if __name__ == "__main__":
    main()
