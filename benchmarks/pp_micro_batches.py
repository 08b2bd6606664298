"""Serving throughput at --pipeline-parallel-size 2 with 1 vs N micro-batches per step, side by side.

    python benchmarks/pp_micro_batches.py [--micro-batches 2] [--num-requests 32] [--max-concurrency 16]

Runs ``paged-server bench-serve`` twice in one process on the same seeded
workload (``continuous_batching``'s prompts and lengths, sent as one burst
with at most ``--max-concurrency`` requests in flight) against the default
model (or ``--model``), first with one micro-batch per step (the
synchronous schedule: a step goes through stage 0, then stage 1), then with
``--micro-batches`` (``PAGED_PP_MICRO_BATCHES``; the engine's default is
one per stage), and prints both JSON reports and one line: output
tokens/s with N micro-batches over one. On CPU the ranks share the
machine's cores: with one micro-batch each rank gets all of them (the
stages take turns), with several each gets cores / ranks (the stages
compute at once), so on 2 cores the ratio says what overlapping stages buy
there, not what two GPUs would. Extra flags go to bench-serve (engine
flags included).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from paged_server.bench.serving import bench_serve
from paged_server.entrypoints.cli import build_parser
from paged_server.entrypoints.openai.engine_args import engine_config_from_args
from paged_server.parallel.pipeline import MICRO_BATCHES_ENV


def run(micro_batches: int, extra: list[str]) -> dict:
    os.environ[MICRO_BATCHES_ENV] = str(micro_batches)  # read when the engine starts its ranks
    args = build_parser().parse_args(["bench-serve", "--pipeline-parallel-size", "2", *extra])
    return bench_serve(args, engine_config_from_args(args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--workload", default="continuous_batching")
    ours, extra = parser.parse_known_args()
    extra = ["--workload", ours.workload, "--request-rate", "inf", "--num-requests", str(ours.num_requests),
             "--max-concurrency", str(ours.max_concurrency), *extra]  # fmt: skip
    reports = {m: run(m, extra) for m in (1, ours.micro_batches)}
    for m, report in reports.items():
        print(json.dumps({"pipeline_parallel_size": 2, "micro_batches": m, **report}, default=str), flush=True)
    one, many = reports[1], reports[ours.micro_batches]
    ratio = (many["output_tokens_per_s"] or 0) / (one["output_tokens_per_s"] or 1)
    print(
        f"PP=2, {ours.micro_batches} micro-batches / 1 output tok/s: {ratio:.2f}x "
        f"({many['output_tokens_per_s']} vs {one['output_tokens_per_s']}) at max concurrency "
        f"{ours.max_concurrency}; inter-token latency p50 {many['itl_ms']['p50']} vs {one['itl_ms']['p50']} ms",
        flush=True,
    )
    sys.exit(0 if one["failed"] == many["failed"] == 0 else 1)


if __name__ == "__main__":
    main()
