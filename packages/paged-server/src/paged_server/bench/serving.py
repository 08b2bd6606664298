"""``paged-server bench-serve``: the benchmark workloads (`bench/workloads.py`) over HTTP.

Requests go to ``POST /v1/completions`` (streaming, token-id prompts, EOS
ignored so every run generates the same tokens) at a Poisson arrival rate
drawn from a seeded generator; the client times every streamed chunk. One
JSON line reports throughput and TTFT / inter-token latency percentiles.

Workloads are those of ``paged_server.bench.workloads`` (``seed`` =
the documents' ``paged_attention`` burst, ``shared_prefix``, ``nano_vllm``)
plus the documents' ``continuous_batching`` (32 requests, prompts 64-512
tokens, 4 requests/s). The server is either started in-process on a free
loopback port (engine flags as for ``serve``) or an existing one (``--url``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import multiprocessing
import random
import re
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from paged_server.bench import workloads as wl

CONTINUOUS_BATCHING = "continuous_batching"
# Arrival rate (requests/s) each workload is defined with; inf = one burst.
DEFAULT_RATES = {CONTINUOUS_BATCHING: 4.0}


@dataclass(slots=True)
class RequestTiming:
    """What the client saw for one request."""

    ok: bool = False
    error: str | None = None
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    done: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0


def build_workload(name: str, pool: list[int], args: argparse.Namespace) -> Any:
    """The named workload, scaled by ``--prompt-scale`` / ``--new-tokens-scale``."""
    if name == CONTINUOUS_BATCHING:
        return wl.burst_workload(
            CONTINUOUS_BATCHING,
            "continuous_batching: 32 requests, prompts 64-512, 32-128 new tokens, 4 req/s",
            pool,
            num_requests=args.num_requests or 32,
            prompt_range=(64, 512),
            new_tokens_range=(32, 128),
            seed=args.seed,
            prompt_scale=args.prompt_scale,
            new_tokens_scale=args.new_tokens_scale,
        )
    return wl.make_workload(
        name,
        pool,
        num_requests=args.num_requests,
        seed=args.seed,
        prompt_scale=args.prompt_scale,
        new_tokens_scale=args.new_tokens_scale,
    )


def workload_names() -> list[str]:
    from paged_server.bench.workloads import WORKLOADS

    return sorted([*WORKLOADS, CONTINUOUS_BATCHING])


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: Poisson
    arrivals (exponential gaps) at ``rate`` per second; all 0 for inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"{seed}:arrivals")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def completion_body(spec: wl.RequestSpec, model: str | None = None) -> dict[str, Any]:
    """The streamed, greedy, EOS-ignoring ``/v1/completions`` body of one
    request (token-id prompt), as any OpenAI-compatible server takes it."""
    body: dict[str, Any] = {
        "prompt": list(spec.prompt_token_ids),
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    return body


async def stream_request(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    delay: float,
    start: float,
    timing: RequestTiming,
    limit: asyncio.Semaphore | None = None,
) -> None:
    """POST ``body`` at ``start + delay`` (once ``limit`` lets it: at most
    ``--max-concurrency`` in flight) and time every streamed chunk into ``timing``."""
    await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
    async with limit if limit is not None else contextlib.nullcontext():
        await _stream(client, body, timing)


async def _stream(client: httpx.AsyncClient, body: dict[str, Any], timing: RequestTiming) -> None:
    timing.sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                timing.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    timing.ok = timing.error is None
                    break
                event = json.loads(data)
                if "error" in event:
                    timing.error = str(event["error"].get("message"))
                    continue
                if event.get("usage"):
                    timing.prompt_tokens = event["usage"]["prompt_tokens"]
                    timing.completion_tokens = event["usage"]["completion_tokens"]
                if any(c.get("text") for c in event.get("choices", [])):
                    timing.chunk_times.append(time.perf_counter())
    except httpx.HTTPError as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    finally:
        timing.done = time.perf_counter()


RUNNING_SAMPLE_S = 0.5  # how often the server's running count is read during a run


async def _sample_running(client: httpx.AsyncClient, samples: list[float]) -> None:
    """Read ``paged:num_requests_running`` from /metrics until cancelled."""
    while True:
        await asyncio.sleep(RUNNING_SAMPLE_S)
        try:
            text = (await client.get("/metrics")).text
        except httpx.HTTPError:
            continue
        for line in text.splitlines():
            m = _METRIC_LINE.match(line)
            if m and m.group(1) == "paged:num_requests_running":
                samples.append(float(m.group(2)))


async def run_workload(
    url: str,
    model: str | None,
    workload: Any,
    rate: float,
    seed: int,
    api_key: str | None,
    running: list[float] | None = None,
    max_concurrency: int | None = None,
) -> tuple[list[RequestTiming], float]:
    """Send every request of ``workload`` at its arrival time, at most
    ``max_concurrency`` at once; returns timings and wall time. ``running``
    (if given) collects the server's running count, sampled every
    ``RUNNING_SAMPLE_S`` seconds."""
    offsets = arrival_offsets(len(workload.requests), rate, seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timings = [RequestTiming() for _ in workload.requests]
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits, headers=headers) as client:
        sampler = asyncio.ensure_future(_sample_running(client, running)) if running is not None else None
        start = time.perf_counter()
        tasks = []
        limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        for spec, delay, timing in zip(workload.requests, offsets, timings, strict=True):
            tasks.append(stream_request(client, completion_body(spec, model), delay, start, timing, limit))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        return timings, wall


def _run_client(send: Callable[..., Any]) -> tuple[list[RequestTiming], float, list[float]]:
    """``send`` (``run_workload`` with its arguments) to completion: timings,
    wall time, and the server's running count sampled meanwhile."""
    running: list[float] = []
    timings, wall = asyncio.run(send(running=running))
    return timings, wall, running


def _client_in_own_process(
    send: Callable[..., Any],
) -> tuple[list[RequestTiming], float, list[float]]:
    """``_run_client`` in a child process, as a real client is: in the
    server's process it would share one GIL with the HTTP and engine threads,
    and the time it spends parsing chunks would show up as server latency."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_run_client, send).result()


def summarize(timings: list[RequestTiming], wall_s: float) -> dict[str, Any]:
    """Throughput and latency percentiles (ms) over the successful requests."""
    from paged_server.bench.results import percentiles

    ok = [t for t in timings if t.ok]
    out_tokens = sum(t.completion_tokens for t in ok)
    prompt_tokens = sum(t.prompt_tokens for t in ok)
    ttft = [(t.chunk_times[0] - t.sent) * 1e3 for t in ok if t.chunk_times]
    itl = [
        (b - a) * 1e3 for t in ok for a, b in zip(t.chunk_times, t.chunk_times[1:], strict=False)
    ]
    e2e = [(t.done - t.sent) * 1e3 for t in ok]
    errors = [t.error for t in timings if not t.ok]
    return {
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "first_error": next((e for e in errors if e), None),
        "duration_s": round(wall_s, 3),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "request_throughput": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
        "output_tokens_per_s": round(out_tokens / wall_s, 2) if wall_s > 0 else None,
        "total_tokens_per_s": round((out_tokens + prompt_tokens) / wall_s, 2) if wall_s > 0 else None,
        "ttft_ms": percentiles(ttft),
        "itl_ms": percentiles(itl),
        "e2e_latency_ms": percentiles(e2e),
    }


_METRIC_LINE = re.compile(r"^(paged:[a-z_]+)(?:\{[^}]*\})? (\S+)$")


def scrape_metrics(url: str, api_key: str | None) -> dict[str, float]:
    """The server's unlabelled-by-bucket ``paged:`` samples from /metrics."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if m and "_bucket" not in m.group(1):
            key = m.group(1).removeprefix("paged:")
            out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


def add_bench_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="benchmark this running server instead of starting one")
    parser.add_argument("--api-key", help="Bearer token for --url")
    parser.add_argument("--served-model-name", help="model id to send (default: none, the server picks its own)")
    parser.add_argument(
        "--tokenizer",
        help="model directory whose tokenizer gives the prompt token pool with --url "
        "(default: --model, else the embedded default model)",
    )
    parser.add_argument("--workload", default=CONTINUOUS_BATCHING, choices=workload_names(),
                        help="which workload of bench/workloads.py to send")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="requests per second, Poisson arrivals; inf = one burst "
        f"(default: the workload's own, {DEFAULT_RATES} else inf)",
    )
    parser.add_argument("--num-requests", type=int, default=None, help="override the workload's count")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight at once (vLLM's bench flag; default: no limit)")
    parser.add_argument("--bench-seed", dest="bench_seed", type=int, default=0,
                        help="seed of the workload and the arrival times")
    parser.add_argument("--prompt-scale", type=float, default=1.0, help="multiply prompt lengths")
    parser.add_argument("--new-tokens-scale", type=float, default=1.0, help="multiply max_tokens")
    parser.add_argument("--output", help="also append the JSON line to this file")


def _tokenizer_for(args: argparse.Namespace) -> Any:
    from paged_server.tokenizer import Tokenizer

    path = args.tokenizer or getattr(args, "model", None)
    if path is None:
        from paged_server.default_model import ensure_default_model

        path = ensure_default_model()
    return Tokenizer.from_dir(path)


def bench_serve(args: argparse.Namespace, config: Any | None) -> dict[str, Any]:
    """Run one benchmark; ``config`` (an ``EngineConfig``) starts an in-process server."""
    args.seed = args.bench_seed
    rate = args.request_rate if args.request_rate is not None else DEFAULT_RATES.get(args.workload, math.inf)
    server = thread = None
    settings_info: dict[str, Any] = {}
    try:
        if args.url:
            url, model, tokenizer = args.url.rstrip("/"), args.served_model_name, _tokenizer_for(args)
        else:
            from paged_server.entrypoints.openai.app import ServerSettings
            from paged_server.entrypoints.openai.async_engine import EngineThread
            from paged_server.entrypoints.openai.server import (
                ServerThread,
                build_engine,
                served_model_name,
            )

            assert config is not None
            thread = EngineThread()  # as serve: the thread that loads the model steps it
            engine = build_engine(config, thread)
            name = served_model_name(config, args.served_model_name)
            server = ServerThread(engine, ServerSettings(model_name=name), thread=thread).start()
            url, model, tokenizer = server.url, name, engine.tokenizer
            settings_info = asdict(engine.config)  # as run: defaults resolved
        workload = build_workload(args.workload, wl.token_pool_from_tokenizer(tokenizer), args)
        send = functools.partial(
            run_workload, url, model, workload, rate, args.seed, args.api_key,
            max_concurrency=getattr(args, "max_concurrency", None),
        )  # fmt: skip
        if server is None:
            timings, wall, running = _run_client(send)
        else:
            timings, wall, running = _client_in_own_process(send)
        server_metrics = scrape_metrics(url, args.api_key)
    finally:
        if server is not None:
            server.stop()
        if thread is not None:
            # End the engine thread, and its OpenMP pool with it: a second run in
            # this process (run_all's budgets) would otherwise step beside an
            # idle pool, and libgomp stops spinning when there are more threads
            # than cores.
            thread.close()
    report: dict[str, Any] = {
        "benchmark": "serve",
        "workload": workload.summary(),
        "request_rate": "inf" if math.isinf(rate) else rate,
        "seed": args.seed,
        "url": args.url or "in-process",
        "num_requests": len(workload.requests),
        **summarize(timings, wall),
        "running": {
            "mean": round(sum(running) / len(running), 1) if running else None,
            "peak": max(running, default=None),
            "samples": len(running),
        },
        "max_concurrency": getattr(args, "max_concurrency", None),
        "server": {
            **{
                k: server_metrics.get(k)
                for k in (
                    "num_preemptions_total",
                    "prefix_cache_queries_total",
                    "prefix_cache_hits_total",
                    "kv_capacity_tokens",
                    "dp_replicas_alive",
                    "dp_requests_routed_by_prefix_total",
                )
            },
            "prefix_cache_hit_rate": _hit_rate(server_metrics),
        },
        "engine_config": settings_info or None,
    }
    return report


def _hit_rate(metrics: dict[str, float]) -> float | None:
    """Prompt tokens served from the prefix cache over those looked up."""
    queries = metrics.get("prefix_cache_queries_total")
    return round(metrics.get("prefix_cache_hits_total", 0.0) / queries, 4) if queries else None
