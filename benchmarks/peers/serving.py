"""paged-server against llama.cpp's llama-server: the same requests, closed loop, alternating runs.

Every run starts one server in a child process, warms it with one short
request, sends the request set at a fixed concurrency (the next request as
soon as one finishes), then stops it. The peer order rotates every repeat,
so slow drift from other load spreads over both; the page shows medians.
Busy cores = CPU seconds of the server's process tree / wall seconds,
read from /proc, next to the whole machine's, so other load shows.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from paged_server.bench import workloads as wl
from paged_server.bench.serving import RequestTiming, completion_body, stream_request, summarize

from . import llamacpp as lc

PAGED = "paged"
PROMPT_RANGE = (100, 400)
NEW_TOKENS = 128
WARMUP_TOKENS = 8
AGREEMENT_TOKENS = 32
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# paged's weight-only --quantization against the GGUF type llama.cpp users run
# for the same bits: int8 (per channel) ~ Q8_0, int4 (groups of 128) ~ Q4_0 (blocks of 32).
QUANTIZED_PAIRS = (("int8", "q8_0"), ("int4", "q4_0"))


def llamacpp_peer(outtype: str) -> str:
    return f"llama.cpp {outtype}"


def paged_quantized_peer(method: str) -> str:
    return f"{PAGED} {method}"


def parse_pairs(text: str) -> list[tuple[str, str]]:
    """``"int8=q8_0,int4=q4_0"`` -> ``[("int8", "q8_0"), ("int4", "q4_0")]``."""
    pairs = []
    for item in (t.strip() for t in text.split(",")):
        method, sep, outtype = item.partition("=")
        if not item:
            continue
        if not sep or not method.strip() or outtype.strip() not in lc.OUTTYPES:
            raise ValueError(f"{item!r} is not METHOD=GGUF_TYPE with a type of {', '.join(lc.OUTTYPES)}")
        pairs.append((method.strip(), outtype.strip()))
    return pairs


def peer_workload(pool: Sequence[int], num_requests: int, seed: int = 0) -> wl.Workload:
    """Prompts of 100-400 token ids, 128 new tokens each; a smaller count is
    the first requests of a larger one (same seed)."""
    return wl.burst_workload(
        "llamacpp_peer",
        f"prompts {PROMPT_RANGE[0]}-{PROMPT_RANGE[1]} token ids, {NEW_TOKENS} new tokens, EOS ignored, "
        "closed loop",
        pool,
        num_requests=num_requests,
        prompt_range=PROMPT_RANGE,
        new_tokens_range=(NEW_TOKENS, NEW_TOKENS),
        seed=seed,
    )


def request_bodies(workload: wl.Workload) -> list[dict[str, Any]]:
    """What every peer is sent: no ``model`` field, each server has one."""
    return [completion_body(spec) for spec in workload.requests]


async def closed_loop(
    url: str, bodies: Sequence[dict[str, Any]], concurrency: int
) -> tuple[list[RequestTiming], float]:
    """``concurrency`` streams, each sending the next body when its last one ends."""
    timings = [RequestTiming() for _ in bodies]
    queue = iter(range(len(bodies)))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:

        async def stream() -> None:
            for i in queue:
                await stream_request(client, bodies[i], 0.0, time.perf_counter(), timings[i])

        start = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(concurrency)))
        return timings, time.perf_counter() - start


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()  # after "pid (comm)"
    except OSError:
        return None


def process_tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (all threads)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))):
            parents[int(entry)] = int(fields[1])
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent and p not in tree]
        tree.update(children)
        frontier += children
    total = 0
    for p in tree:
        if fields := _stat_fields(p):
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _CLK_TCK


def machine_busy_cpu_s() -> float:
    """CPU seconds every core spent busy (not idle or iowait) since boot."""
    with open("/proc/stat", encoding="utf-8") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / _CLK_TCK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rotation(peers: Sequence[str], repeat: int) -> list[str]:
    """The peer order of repeat ``repeat``: each repeat starts one peer later."""
    k = repeat % len(peers)
    return [*peers[k:], *peers[:k]]


Starter = Callable[[int, int, Path | None], Any]  # (port, concurrency, log) -> Popen


def measure_run(start_server: Starter, bodies: Sequence[dict[str, Any]], concurrency: int,
                log: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """Start a server, warm it, run the closed loop, stop it; one run's summary."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(port, concurrency, log)
    try:
        lc.wait_healthy(proc, url)
        warm = {**bodies[0], "max_tokens": WARMUP_TOKENS, "stream": False}
        warm.pop("stream_options", None)
        httpx.post(f"{url}/v1/completions", json=warm, timeout=600).raise_for_status()
        server0, machine0, self0 = process_tree_cpu_s(proc.pid), machine_busy_cpu_s(), _self_cpu_s()
        timings, wall = asyncio.run(closed_loop(url, bodies, concurrency))
        server = process_tree_cpu_s(proc.pid) - server0
        machine = machine_busy_cpu_s() - machine0
        client = _self_cpu_s() - self0
    finally:
        lc.stop(proc)
    out = summarize(timings, wall)
    out["busy_cores"] = {
        "server": round(server / wall, 2),
        "client": round(client / wall, 2),
        "machine": round(machine / wall, 2),
        "other": round(max(0.0, machine - server - client) / wall, 2),
    }
    out["loadavg_1m"] = os.getloadavg()[0]
    return out


def _self_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def headline(run: dict[str, Any]) -> dict[str, float | None]:
    """The numbers the page compares, from one run's summary."""
    return {
        "output_tokens_per_s": run["output_tokens_per_s"],
        "ttft_p50_ms": run["ttft_ms"]["p50"],
        "itl_p50_ms": run["itl_ms"]["p50"],
        "itl_p99_ms": run["itl_ms"]["p99"],
        "busy_cores": run["busy_cores"]["server"],
        "other_cores": run["busy_cores"]["other"],
    }


def medians(runs: Sequence[dict[str, float | None]]) -> dict[str, float | None]:
    """Per key, the median over repeats (None where no run has a value)."""
    out: dict[str, float | None] = {}
    for key in runs[0]:
        vals = [r[key] for r in runs if r[key] is not None]
        out[key] = round(statistics.median(vals), 3) if vals else None
    return out


def ratios(by_peer: dict[str, dict[str, float | None]]) -> dict[str, float | None]:
    """paged's output tokens/s over each llama.cpp peer's, and over the best of them."""
    ours = by_peer[PAGED]["output_tokens_per_s"]
    out: dict[str, float | None] = {}
    best = 0.0
    for peer, m in by_peer.items():
        theirs = m["output_tokens_per_s"]
        if not peer.startswith("llama.cpp") or not theirs:
            continue
        best = max(best, theirs)
        out[f"paged / {peer}"] = round(ours / theirs, 3) if ours else None
    out["paged / best llama.cpp"] = round(ours / best, 3) if ours and best else None
    return out


def pair_ratios(by_peer: dict[str, dict[str, float | None]], pairs: Sequence[tuple[str, str]]) -> dict[str, float | None]:
    """Each paged peer's output tokens/s over its llama.cpp partner's."""
    out: dict[str, float | None] = {}
    for ours, theirs in pairs:
        a, b = by_peer[ours]["output_tokens_per_s"], by_peer[theirs]["output_tokens_per_s"]
        out[f"{ours} / {theirs}"] = round(a / b, 3) if a and b else None
    return out


def greedy_agreement(start_server: Callable[[int], Any], prompts: Sequence[Sequence[int]],
                     max_tokens: int = AGREEMENT_TOKENS) -> list[str]:  # fmt: skip
    """The greedy completion text of each prompt on one server (started, then stopped)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(port)
    try:
        lc.wait_healthy(proc, url)
        texts = []
        for ids in prompts:
            body = {"prompt": list(ids), "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
            r.raise_for_status()
            texts.append(r.json()["choices"][0]["text"])
        return texts
    finally:
        lc.stop(proc)


def requests_for(concurrency: int, num_requests: int, single_stream_requests: int) -> int:
    """How many requests a run at ``concurrency`` sends (at least two waves)."""
    return single_stream_requests if concurrency == 1 else max(num_requests, 2 * concurrency)


def schedule(
    peers: Sequence[str], concurrencies: Sequence[int], repeats: int, num_requests: int,
    single_stream_requests: int,
) -> list[tuple[int, int, str, int]]:  # fmt: skip
    """Every run as ``(repeat, concurrency, peer, number of requests)``: each
    peer once per repeat and concurrency, in an order that rotates, every peer
    at one concurrency sent the same first requests of the one request set."""
    out = []
    for repeat in range(repeats):
        for i, concurrency in enumerate(concurrencies):
            n = requests_for(concurrency, num_requests, single_stream_requests)
            out += [(repeat, concurrency, peer, n) for peer in rotation(peers, repeat + i)]
    return out


def compare(
    model_dir: str | Path,
    *,
    outtypes: Sequence[str] = ("f32", "f16"),
    concurrencies: Sequence[int] = (1, 8, 16, 32),
    repeats: int = 2,
    num_requests: int = 64,
    single_stream_requests: int = 8,
    agreement_prompts: int = 5,
    threads: int = 2,
    seed: int = 0,
    log_dir: Path | None = None,
    emit: Callable[[dict[str, Any]], None] = print,
    paged_variants: Sequence[str] = (),
    quantized: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """The whole side-by-side comparison on one model; the results JSON.
    ``paged_variants``: more paged-server peers, each with these extra flags
    (e.g. ``"--enforce-eager"``), named ``"paged <flags>"``.
    ``quantized``: ``(method, outtype)`` pairs instead (e.g. ``QUANTIZED_PAIRS``):
    ``paged --quantization method`` (named ``"paged <method>"``) against llama.cpp
    serving the ``outtype`` GGUF, no dense peers; ``outtypes`` is ignored.
    Greedy text is compared within each pair, and ratios are pair by pair.
    Raises ``FileNotFoundError`` (with ``lc.missing_message()``) without a build."""
    import json

    from paged_server.tokenizer import Tokenizer

    tree = lc.find_llamacpp()
    if tree is None:
        raise FileNotFoundError(lc.missing_message())
    config = json.loads(Path(model_dir, "config.json").read_text(encoding="utf-8"))
    pool = wl.token_pool_from_tokenizer(Tokenizer.from_dir(model_dir), config["vocab_size"])
    largest = max(requests_for(c, num_requests, single_stream_requests) for c in concurrencies)
    workload = peer_workload(pool, largest, seed)
    ctx = -(-workload.max_model_len // 256) * 256  # per sequence, rounded up
    if quantized:
        outtypes = [t for _, t in quantized]
    ggufs = {t: lc.convert_to_gguf(tree, model_dir, t) for t in outtypes}

    def log(name: str) -> Path | None:
        return log_dir / f"{name}.log" if log_dir else None

    def paged(port: int, _c: int = 1, logfile: Path | None = None, extra: str = "") -> Any:
        return lc.start_paged_server(model_dir, port, tuple(extra.split()), log=logfile)

    def llama(outtype: str) -> Starter:
        def start(port: int, concurrency: int = 1, logfile: Path | None = None) -> Any:
            return lc.start_llama_server(tree, ggufs[outtype], port, parallel=concurrency,
                                         ctx_per_seq=ctx, threads=threads, log=logfile)  # fmt: skip

        return start

    starters: dict[str, Starter] = {}
    if quantized:
        pairs = [(paged_quantized_peer(m), llamacpp_peer(t)) for m, t in quantized]
        for (ours, theirs), (method, t) in zip(pairs, quantized, strict=True):
            starters[ours] = functools.partial(paged, extra=f"--quantization {method}")
            starters[theirs] = llama(t)
    else:
        pairs = [(PAGED, llamacpp_peer(t)) for t in outtypes]
        starters[PAGED] = paged
        for flags in paged_variants:
            starters[f"{PAGED} {flags}"] = functools.partial(paged, extra=flags)
        starters.update({llamacpp_peer(t): llama(t) for t in outtypes})
    prompts = [r.prompt_token_ids for r in workload.requests[:agreement_prompts]]
    texts: dict[str, list[str]] = {}  # greedy text per peer, each asked once
    agreement = {}
    for (ours, theirs), t in zip(pairs, outtypes, strict=True):
        for peer in (ours, theirs):
            if peer not in texts:
                slug = peer.replace(" ", "-")
                texts[peer] = greedy_agreement(lambda port, p=peer, s=slug: starters[p](port, 1, log(f"agree-{s}")),
                                               prompts)  # fmt: skip
        same = [a == b for a, b in zip(texts[ours], texts[theirs], strict=True)]
        # quantized formats round differently (per channel / groups of 128 vs blocks of 32): reported, not required
        agreement[t] = {"agree": sum(same), "of": len(same), "paged_peer": ours, "paged": texts[ours],
                        "llama.cpp": texts[theirs]}  # fmt: skip
        emit({"kind": "agreement", "outtype": t, "paged_peer": ours, "agree": sum(same), "of": len(same)})

    peers = list(starters)
    runs: list[dict[str, Any]] = []
    all_bodies = request_bodies(workload)
    for repeat, concurrency, peer, n in schedule(peers, concurrencies, repeats, num_requests, single_stream_requests):
        run = measure_run(starters[peer], all_bodies[:n], concurrency, log(f"{peer}-c{concurrency}-r{repeat}"))
        record = {"peer": peer, "concurrency": concurrency, "repeat": repeat, "num_requests": n, **run}
        emit({"kind": "peer_run", **record})
        runs.append(record)
    table = []
    for concurrency in concurrencies:
        by_peer = {
            peer: medians([headline(r) for r in runs if r["peer"] == peer and r["concurrency"] == concurrency])
            for peer in peers
        }
        row = {"concurrency": concurrency, "medians": by_peer,
               "ratios": pair_ratios(by_peer, pairs) if quantized else ratios(by_peer)}  # fmt: skip
        emit({"kind": "peer_medians", **row})
        table.append(row)
    return {
        "llamacpp": {
            "version": tree.version,
            "flags": list(lc.cmake_flags()),
            "server_args": f"--parallel N -c N*{ctx} --cont-batching -t {threads} -tb {threads}",
            "gguf_bytes": {t: p.stat().st_size for t, p in ggufs.items()},
        },
        "paged_args": "serve --model DIR (defaults)"
        + (" --quantization METHOD" if quantized else ""),
        "paged_variants": list(paged_variants),
        "pairs": [list(p) for p in pairs],
        "workload": workload.summary(),
        "plan": {
            "outtypes": list(outtypes), "concurrencies": list(concurrencies), "repeats": repeats,
            "num_requests": num_requests, "single_stream_requests": single_stream_requests,
            "ctx_per_seq": ctx, "threads": threads,
        },  # fmt: skip
        "agreement": agreement,
        "runs": runs,
        "table": table,
    }
