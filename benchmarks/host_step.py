"""Host time of one decode step: everything ``LLMEngine.step()`` does but the forward.

The model is replaced by a no-op of the same shapes (the ~100M bench
model's hidden size and vocabulary: ``hidden_states`` returns an empty
``[num_tokens, hidden]`` tensor, ``compute_logits`` rows of one
preallocated contiguous ``[max rows, vocab]`` tensor, laid out as a real
LM head's output is: a stride-0 ``expand()`` would send the sampler's
``row_max`` down torch's slow strided path, ~1 ms per step no real model
pays; row ``r`` peaks at an ordinary token, ``_FIRST_WORD + r``, so every
sampled token is detokenized as real text is: the special token 0 that an
all-zero row gives is skipped by the detokenizer for free), so what is
timed is the host's work each step: retire, schedule (room reserved per
sequence), the step's layout (``step_layout``), the flat batch,
commit (``mark_computed``), sampling (greedy here), detokenization and stop
checks. 256 running sequences at a 2,048-token context (issue 29's target:
<= 1 ms on the critical path, below).
The KV pool has one layer of one 8-wide head: the no-op never reads it, and
only its page tables matter for host time.

A server's engine thread also hands each step's outputs to the event loop
(``AsyncEngine._route``): timed on its own as ``route_ms_per_step_median``,
with the server's Prometheus histograms and an event loop that runs the
hand-off between steps, outside the timing.

The critical path (``critical_ms_per_step_median``) is the step less what
a GPU's forward pass would overlap: the host part from launching the pass
to first waiting for the device (``_DeviceWindow``).

Run: ``python benchmarks/host_step.py [--seqs 256] [--context 2048] [--no-detokenize]
[--async-output-proc] [--model DIR]``; prints one JSON line: median wall, thread-CPU and
critical-path ms per step (``--profile``: a cProfile list on stderr).
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
from paged_server.engine.core.llm_engine import LLMEngine
from paged_server.engine.sample import sampler
from paged_server.entrypoints.openai.async_engine import AsyncEngine, _Tracked
from paged_server.entrypoints.openai.metrics import ServerMetrics
from paged_server.models import load_model
from paged_server.models.pipeline_parallel import WHOLE
from paged_server.models.tensor_parallel import SINGLE
from paged_server.sampling_params import SamplingParams

_FIRST_WORD = 300  # above the embedded tokenizer's special ids (0-2)


class NoOpModel(nn.Module):
    """The forward contract of ``models/base.py`` with no work behind it, or
    (``device_s``) a device stand-in: each pass takes that long without
    holding the GIL, as a GPU's does, and says when it ran (``passes``)."""

    def __init__(self, hidden_size: int, vocab_size: int, device_s: float = 0.0) -> None:
        super().__init__()
        self.device_s = device_s
        self.passes: list[tuple[float, float]] = []  # (start, end) of each pass
        self.tp, self.pp = SINGLE, WHOLE
        self.graph_safe = False  # nothing to compile
        self.anchor = nn.Parameter(torch.zeros(1), requires_grad=False)  # the engine reads the device
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.logits = self._peaked_rows(0)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, view: Any) -> torch.Tensor:
        start = time.perf_counter()
        if self.device_s:
            time.sleep(self.device_s)  # releases the GIL, as a pass on a device does
        self.passes.append((start, time.perf_counter()))
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


def build(
    num_seqs: int, context: int, steps: int, async_output_proc: bool = False, model: str | None = None,
    async_scheduling: bool = False, device_s: float = 0.0,
) -> LLMEngine:
    loaded = load_model(model or str(ensure_llama_100m()), torch.float32, torch.device("cpu"))
    mc = loaded.config
    tiny_kv = dataclasses.replace(mc, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8)
    no_op = NoOpModel(mc.hidden_size, mc.vocab_size, device_s)
    loaded = dataclasses.replace(loaded, model=no_op, config=tiny_kv)
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
        async_scheduling=async_scheduling,
    )
    return LLMEngine(config, loaded)


class _DeviceWindow:
    """Per step, when the forward pass was launched (``engine._forward``
    returned) and when the sampler's greedy max (``sampler.row_max``) first
    returned. On a GPU the host runs ahead of the device between the two: it
    waits for the device first right after that max (its result read on the
    host), so what runs in between (``async_output_proc``'s text of the last
    step, the commit, the sampler's set-up) overlaps the pass, and the max
    itself (a memory-bound pass over the ``[batch, vocab]`` logits, ~0.3 ms
    on one core of this CPU) is a device kernel. The rest of the step is
    host time the device waits for: the critical path."""

    def __init__(self, engine: LLMEngine) -> None:
        self.launched: float | None = None
        self.windows: list[float] = []
        self.greedy_max: list[float] = []
        execute, row_max = engine._forward, sampler.row_max

        def timed_execute(scheduled: Any) -> Any:
            out = execute(scheduled)
            self.launched = time.perf_counter()
            return out

        def timed_row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            start = time.perf_counter()
            out = row_max(logits)
            end = time.perf_counter()
            if self.launched is not None:  # the step's first max: its device wait follows
                self.windows[-1] += end - self.launched
                self.greedy_max[-1] += end - start
                self.launched = None
            return out

        engine._forward = timed_execute  # type: ignore[method-assign]
        sampler.row_max = timed_row_max
        self._row_max = row_max

    def close(self) -> None:
        """Put the sampler's own ``row_max`` back (the engine is dropped)."""
        sampler.row_max = self._row_max

    def next_step(self) -> None:
        self.launched = None
        self.windows.append(0.0)
        self.greedy_max.append(0.0)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default=None,
        help="checkpoint whose shapes and tokenizer the no-op takes (default: the ~100M bench model)",
    )  # fmt: skip
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--profile", action="store_true", help="cProfile the timed steps (stderr)")
    p.add_argument(
        "--async-output-proc", action="store_true",
        help="EngineConfig.async_output_proc: the last step's text and outputs are made "
        "while the pass runs, off the critical path",
    )  # fmt: skip
    p.add_argument(
        "--async-scheduling", action="store_true",
        help="EngineConfig.async_scheduling: the next step is planned, and the last one's tokens "
        "appended and turned into outputs, while the pass runs on the launch thread",
    )  # fmt: skip
    p.add_argument(
        "--device-ms", type=float, default=0.0,
        help="make each forward pass a device stand-in that takes this long without holding "
        "the GIL (0: a no-op)",
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
    engine = build(
        args.seqs, args.context, args.steps, args.async_output_proc, args.model,
        args.async_scheduling, args.device_ms / 1e3,
    )  # fmt: skip
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
    # The no-op stands in for a GPU's pass, which leaves the GIL free, so the
    # server does not wait for its event loop after a step (never run here).
    server.handoff_wait_s = 0.0
    for i in range(args.seqs):  # as add_request tracks them (the loop is never started)
        server._tracked[f"r{i}"] = _Tracked(loop, asyncio.Queue(), time.monotonic(), 1)
    window = _DeviceWindow(engine)
    passes = engine.worker.model.passes
    first_pass = len(passes)
    maxima = _time_launch_thread_maxima() if args.async_scheduling else None
    profiler = cProfile.Profile() if args.profile else None
    times, cpu_times, route_times = [], [], []
    try:
        for _ in range(args.steps):
            if profiler is not None:
                profiler.enable()
            window.next_step()
            start, cpu_start = time.perf_counter(), time.thread_time()
            outputs = engine.step()
            times.append(time.perf_counter() - start)
            cpu_times.append(time.thread_time() - cpu_start)
            start = time.perf_counter()
            server._route(outputs)
            route_times.append(time.perf_counter() - start)
            if profiler is not None:
                profiler.disable()
            loop.run_until_complete(asyncio.sleep(0))  # the event loop's side of the hand-off
            assert len(outputs) == args.seqs, (len(outputs), engine.metrics())
    finally:
        window.close()
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
        # the step less what runs while a GPU's pass does: with async
        # scheduling, what the device waits for between passes (the gap less
        # the greedy max the launch thread takes there, a kernel on a GPU);
        # else see _DeviceWindow
        "critical_ms_per_step_median": round(
            statistics.median(
                _critical(passes[first_pass:], maxima) if maxima is not None
                else [t - w for t, w in zip(times, window.windows, strict=True)]
            ) * 1e3, 3,
        ),  # fmt: skip
        "pass_gap_ms_median": round(statistics.median(_gaps(passes[first_pass:])) * 1e3, 3),
        "device_ms": args.device_ms,
        "async_scheduling": args.async_scheduling,
        "greedy_max_ms_per_step_median": round(statistics.median(window.greedy_max) * 1e3, 3),
        "async_output_proc": args.async_output_proc,
        "torch_threads": torch.get_num_threads(),
        "detokenize": args.detokenize,
    }
    print(json.dumps(result), flush=True)
    return result


def _gaps(passes: list[tuple[float, float]]) -> list[float]:
    """Seconds between one pass's end and the next one's start."""
    return [b[0] - a[1] for a, b in zip(passes, passes[1:], strict=False)]


def _time_launch_thread_maxima() -> list[tuple[float, float]]:
    """Record (start, end) of every row max the engine takes beside its
    passes (``with_row_max`` on the launch thread)."""
    from paged_server.engine.core import llm_engine

    spans: list[tuple[float, float]] = []
    real = llm_engine.row_max

    def timed(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        out = real(logits)
        spans.append((start, time.perf_counter()))
        return out

    llm_engine.row_max = timed
    return spans


def _critical(passes: list[tuple[float, float]], maxima: list[tuple[float, float]]) -> list[float]:
    """Each gap between passes less the device work in it (the row max)."""
    out = []
    for a, b in zip(passes, passes[1:], strict=False):
        device = sum(min(e, b[0]) - max(s, a[1]) for s, e in maxima if s < b[0] and e > a[1])
        out.append(b[0] - a[1] - device)
    return out


if __name__ == "__main__":
    main()
