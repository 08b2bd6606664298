"""What a prompt chunk adds to a decode step, as `serve` runs it on a CPU.

Builds the offline engine with `serve`'s defaults (the embedded model, bf16
where the CPU has it, compiled), keeps ``--decodes`` sequences decoding, and
times single steps (wall, median) that also carry a fresh prompt chunk:

- ``chunk``: steps carrying a chunk of each ``--chunks`` size, the short
  chunks' route through the C decode kernel (``CpuDecodeOps.prefill_as_decodes``,
  a row at a time) against ``prefill_by_sequence`` (threshold 0), the two
  alternating step by step;
- ``new_rows``: steps whose row count the process has not seen before
  against the same count a second time (oneDNN builds a matmul per row
  count: the compiled forward pads rows to buckets its warm-up ran, so the
  two should match).

Run: ``python benchmarks/mixed_steps.py [--decodes 8] [--rounds 15]``;
prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from paged_ref.cpu.cpu_decode import CpuDecodeOps
from paged_server.entrypoints.llm import LLM
from paged_server.sampling_params import SamplingParams


class _Bench:
    def __init__(self, decodes: int) -> None:
        self.engine = LLM().engine
        self.rng = random.Random(0)
        keep = SamplingParams(max_tokens=1900, ignore_eos=True, temperature=0)
        for i in range(decodes):
            self.engine.add_request(f"decode-{i}", self.prompt(100), keep)
        for _ in range(30):
            self.engine.step()
        self.count = 0

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(5, 1000) for _ in range(n)]

    def step_with_chunk(self, n: int) -> float:
        """Wall ms of one step carrying a fresh ``n``-token prompt (0: a decode
        step). The prompt asks for one token, so a later step retires it."""
        if n:
            self.count += 1
            self.engine.add_request(f"chunk-{self.count}", self.prompt(n), SamplingParams(max_tokens=1))
        start = time.perf_counter()
        self.engine.step()
        return (time.perf_counter() - start) * 1e3


def chunk_sizes(bench: _Bench, chunks: list[int], rounds: int) -> list[dict[str, Any]]:
    default = CpuDecodeOps.prefill_as_decodes
    times: dict[tuple[str, int], list[float]] = {}
    try:
        for _ in range(rounds):
            for n in chunks:
                for route, threshold in (("prefill_by_sequence", 0), ("as_decodes", default)):
                    CpuDecodeOps.prefill_as_decodes = threshold
                    times.setdefault((route, n), []).append(bench.step_with_chunk(n))
    finally:
        CpuDecodeOps.prefill_as_decodes = default
    return [
        {
            "measure": "chunk",
            "chunk_tokens": n,
            "key_reads": n * (n + 1) // 2,
            "as_decodes_threshold": default,
            "step_ms_prefill_by_sequence": round(statistics.median(times[("prefill_by_sequence", n)]), 2),
            "step_ms_as_decodes": round(statistics.median(times[("as_decodes", n)]), 2),
        }
        for n in chunks
    ]


def new_row_counts(bench: _Bench) -> dict[str, Any]:
    first, again = [], []
    for n in (37, 41, 53, 59, 67, 71, 83, 97, 101, 113, 131, 149):  # row counts no step had
        for into in (first, again):
            into.append(bench.step_with_chunk(n))
            bench.step_with_chunk(0)
    return {
        "measure": "new_rows",
        "step_ms_first_time": [round(t, 1) for t in first],
        "step_ms_again": [round(t, 1) for t in again],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decodes", type=int, default=8, help="sequences decoding beside each chunk")
    p.add_argument("--chunks", default="16,32,64,96,128,192", help="chunk sizes (tokens)")
    p.add_argument("--rounds", type=int, default=15, help="steps per chunk size and route")
    args = p.parse_args(argv)
    bench = _Bench(args.decodes)
    for row in (*chunk_sizes(bench, [int(c) for c in args.chunks.split(",")], args.rounds), new_row_counts(bench)):
        print(json.dumps({"benchmark": "mixed_steps", "decodes": args.decodes, **row}), flush=True)


if __name__ == "__main__":
    main()
