"""Host time of one decode step: everything ``LLMEngine.step()`` does but the forward.

The model is replaced by a no-op of the same shapes (the ~100M bench
model's hidden size and vocabulary: ``hidden_states`` returns an empty
``[num_tokens, hidden]`` tensor, ``compute_logits`` rows of one
preallocated contiguous ``[max rows, vocab]`` tensor, laid out as a real
LM head's output is: a stride-0 ``expand()`` would send the sampler's
``row_max`` down torch's slow strided path, ~1 ms per step no real model
pays; row ``r`` peaks at an ordinary token, ``_FIRST_WORD + r``, so every
sampled token is detokenized as real text is: the special token 0 that an
all-zero row gives is skipped by the detokenizer for free), so what is timed is what a GPU would wait for on the
host each step: retire, schedule (room reserved per sequence), the step's
metadata (``step_view``), the runner's batch layout, commit
(``mark_computed``), sampling (greedy here), detokenization and stop checks.
256 running sequences at a 2,048-token context (issue 29's target: <= 1 ms).
The KV pool has one layer of one 8-wide head: the no-op never reads it, and
only its page tables matter for host time.

A server's engine thread also hands each step's outputs to the event loop
(``AsyncEngine._route``): timed on its own as ``route_ms_per_step_median``,
with the server's Prometheus histograms and an event loop that runs the
hand-off between steps, outside the timing.

Run: ``python benchmarks/host_step.py [--seqs 256] [--context 2048] [--no-detokenize]
[--async-output-proc]``; prints
one JSON line: median wall and thread-CPU ms per step (``--profile``: a
cProfile list on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import json
import pstats
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

from paged_server.bench.model_configs import ensure_llama_100m
from paged_server.config import EngineConfig
from paged_server.engine import sampler
from paged_server.engine.llm_engine import LLMEngine
from paged_server.entrypoints.openai.async_engine import AsyncEngine, _Tracked
from paged_server.entrypoints.openai.metrics import ServerMetrics
from paged_server.models import load_model
from paged_server.models.pipeline_parallel import WHOLE
from paged_server.models.tensor_parallel import SINGLE
from paged_server.sampling_params import SamplingParams

_FIRST_WORD = 300  # above the embedded tokenizer's special ids (0-2)


class NoOpModel(nn.Module):
    """The forward contract of ``models/base.py`` with no work behind it."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.tp, self.pp = SINGLE, WHOLE
        self.graph_safe = False  # nothing to compile
        self.anchor = nn.Parameter(torch.zeros(1), requires_grad=False)  # the engine reads the device
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.logits = self._peaked_rows(0)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, view: Any) -> torch.Tensor:
        return torch.empty(input_ids.shape[0], self.hidden_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        if rows > self.logits.shape[0]:
            self.logits = self._peaked_rows(rows)
        return self.logits[:rows]

    def _peaked_rows(self, rows: int) -> torch.Tensor:
        logits = torch.zeros(rows, self.vocab_size)
        peaks = (_FIRST_WORD + torch.arange(rows)) % self.vocab_size
        logits[torch.arange(rows), peaks] = 1.0
        return logits


def build(num_seqs: int, context: int, steps: int, async_output_proc: bool = False) -> LLMEngine:
    loaded = load_model(str(ensure_llama_100m()), torch.float32, torch.device("cpu"))
    mc = loaded.config
    tiny_kv = dataclasses.replace(mc, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8)
    loaded = dataclasses.replace(loaded, model=NoOpModel(mc.hidden_size, mc.vocab_size), config=tiny_kv)
    max_len = context + steps + 80
    config = EngineConfig(
        device="cpu",
        attention_backend="ref",
        max_batch_size=num_seqs,
        max_model_len=max_len,
        max_num_batched_tokens=max(num_seqs, 65536),  # prefill in a few steps
        num_gpu_blocks=num_seqs * (-(-max_len // 16)) + 16,
        enable_prefix_caching=False,
        async_output_proc=async_output_proc,
    )
    return LLMEngine(config, loaded)


def _time_overlapped_part(engine: LLMEngine) -> list[float]:
    """Seconds each step spends making the last step's text and outputs
    (``async_output_proc``; 0 otherwise): work a GPU's pass would overlap."""
    spent = [0.0]
    inner = engine._text_of_last_step

    def timed() -> None:
        start = time.perf_counter()
        inner()
        spent[0] += time.perf_counter() - start

    engine._text_of_last_step = timed  # type: ignore[method-assign]
    return spent


def _time_greedy_max(steps: list[float]) -> None:
    """Add the seconds each step spends in the sampler's greedy max
    (``sampler.row_max``) to ``steps[-1]``: a memory-bound pass over the
    ``[batch, vocab]`` logits (4 MB here, ~0.3 ms on one core of this CPU)
    that is a device kernel on a GPU, where the host only launches it (its
    launches, a few microseconds, are counted in with it here)."""
    inner = sampler.row_max

    def timed(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        out = inner(logits)
        steps[-1] += time.perf_counter() - start
        return out

    sampler.row_max = timed


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--profile", action="store_true", help="cProfile the timed steps (stderr)")
    p.add_argument(
        "--async-output-proc", action="store_true",
        help="EngineConfig.async_output_proc: also report the critical path, the step less "
        "the text and outputs of the last step (made while a GPU's pass would run)",
    )  # fmt: skip
    p.add_argument(
        "--detokenize", action=argparse.BooleanOptionalAction, default=True,
        help="SamplingParams.detokenize (--no-detokenize: token ids only, as an offline "
        "token-id workload runs)",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=int, default=1,
        help="torch threads (1: the host work is Python and small ops; on a shared machine "
        "OpenMP's busy-wait makes multi-threaded small ops wait for descheduled workers)",
    )  # fmt: skip
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = build(args.seqs, args.context, args.steps, args.async_output_proc)
    params = SamplingParams(
        max_tokens=args.steps + 64, ignore_eos=True, temperature=0, detokenize=args.detokenize
    )
    for i in range(args.seqs):  # distinct prompts, context - 1 tokens each
        engine.add_request(f"r{i}", [(i + j) % 4000 + 10 for j in range(args.context - 1)], params)
    while any(s.num_computed_tokens < args.context - 1 for s in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()  # prefill; the last prefill step samples each first token
    assert len(engine.scheduler.running) == args.seqs
    for _ in range(4):
        engine.step()
    loop = asyncio.new_event_loop()
    server = AsyncEngine(engine, ServerMetrics("host_step"))
    for i in range(args.seqs):  # as add_request tracks them (the loop is never started)
        server._tracked[f"r{i}"] = _Tracked(loop, asyncio.Queue(), time.monotonic(), 1)
    overlapped = _time_overlapped_part(engine)
    profiler = cProfile.Profile() if args.profile else None
    times, cpu_times, route_times, critical = [], [], [], []
    greedy_max: list[float] = []
    _time_greedy_max(greedy_max)
    for _ in range(args.steps):
        if profiler is not None:
            profiler.enable()
        overlapped[0] = 0.0
        greedy_max.append(0.0)
        start, cpu_start = time.perf_counter(), time.thread_time()
        outputs = engine.step()
        times.append(time.perf_counter() - start)
        critical.append(times[-1] - overlapped[0])
        cpu_times.append(time.thread_time() - cpu_start)
        start = time.perf_counter()
        server._route(outputs)
        route_times.append(time.perf_counter() - start)
        if profiler is not None:
            profiler.disable()
        loop.run_until_complete(asyncio.sleep(0))  # the event loop's side of the hand-off
        assert len(outputs) == args.seqs, (len(outputs), engine.metrics())
    loop.close()
    if profiler is not None:
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(30)
    result = {
        "benchmark": "host_step",
        "num_seqs": args.seqs,
        "context": args.context,
        "steps": args.steps,
        "host_ms_per_step_median": round(statistics.median(times) * 1e3, 3),
        "host_ms_per_step_min": round(min(times) * 1e3, 3),
        # CPU time of this thread: what the step costs without the waits a
        # shared machine adds (wall time above includes being descheduled).
        "host_cpu_ms_per_step_median": round(statistics.median(cpu_times) * 1e3, 3),
        "route_ms_per_step_median": round(statistics.median(route_times) * 1e3, 3),
        # --async-output-proc: the step less what a GPU's forward pass would hide
        "critical_ms_per_step_median": round(statistics.median(critical) * 1e3, 3),
        # the sampler's greedy max, a kernel on a GPU (see _time_greedy_max) ...
        "greedy_max_ms_per_step_median": round(statistics.median(greedy_max) * 1e3, 3),
        # ... and the critical path less it: the host's own part
        "critical_host_ms_per_step_median": round(
            statistics.median(c - g for c, g in zip(critical, greedy_max, strict=True)) * 1e3, 3
        ),
        "async_output_proc": args.async_output_proc,
        "torch_threads": torch.get_num_threads(),
        "detokenize": args.detokenize,
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
