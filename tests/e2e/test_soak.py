"""Soak: the real server under mixed load with a pool far smaller than the
demand, so preemption never stops.

Clients mix streaming and non-streaming completions and chats, ``n > 1``,
beam search, prompts that share prefixes, clients that hang up mid-stream or
give up waiting, and malformed requests. A second server, on a tiny Gemma 3
with sliding-window and global layers (a hybrid pool: one full KV cache
group, three sliding ones), takes the same kinds of load on a small pool at
the same time (issue 28: beam searches deadlocked a small pool, and a
preempted fork of a hybrid model never came back). Afterwards: no 5xx, every well-formed
request completed or was given up by its client, the KV audit is clean,
KV usage is back to 0, RSS did not grow past a margin after warm-up, and
no thread or asyncio task is left behind.

Bounded: ``PAGED_SOAK_SECONDS`` (default 30) of load; set it higher for a
longer soak."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import threading
import time
from typing import Any

import httpx
import pytest
import torch

from .conftest import MAX_SEQ_LEN, MODEL, start_server, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SECONDS = float(os.environ.get("PAGED_SOAK_SECONDS", "30"))
WARM_UP_S = min(15.0, SECONDS / 4)
CLIENTS = 16
HYBRID_CLIENTS = 4  # on the hybrid model's server, at the same time
BLOCK_SIZE = 16
NUM_BLOCKS = 12  # 192 tokens; 16 clients x ~70 tokens x n want ~6x that
# Resident memory may grow this much after warm-up (allocator caches, the
# tokenizer's caches); a per-request leak over thousands of requests would not fit.
RSS_MARGIN_BYTES = 64 * 2**20
PREFIXES = [f"Shared system preamble number {i}: " + "be helpful and brief. " * 4 for i in range(3)]
BAD_BODIES: list[dict[str, Any] | str] = [
    {"prompt": "x", "max_tokens": -1},
    {"prompt": "x", "n": 999},
    {"prompt": "x", "temperature": "hot"},
    {"prompt": "x", "use_beam_search": True, "stream": True},
    {"prompt": "word " * (MAX_SEQ_LEN * 2), "max_tokens": 4},
    {"model": "no-such-model", "prompt": "x"},
    "{not json",
]


def rss_bytes() -> int:
    """This process's resident set (the server runs in it, on threads)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def server_tasks(server: Any) -> int:
    """Asyncio tasks alive on the server's event loop (besides this probe)."""

    async def count() -> int:
        return len(asyncio.all_tasks() - {asyncio.current_task()})

    loop = server.app.state.loop
    return asyncio.run_coroutine_threadsafe(count(), loop).result(10)


class Tally:
    def __init__(self) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []

    def fail(self, what: str) -> None:
        self.failures.append(what)


def prompt(rng: random.Random) -> str:
    return rng.choice(PREFIXES) + f"question {rng.randrange(10**6)} about " + "data " * rng.randrange(1, 8)


async def completion(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    n = rng.choice([1, 1, 2])
    body = {"model": MODEL, "prompt": prompt(rng), "max_tokens": rng.randrange(4, 24), "n": n,
            "ignore_eos": rng.random() < 0.7}
    resp = await client.post("/v1/completions", json=body)
    if resp.status_code != 200:
        tally.fail(f"completion: {resp.status_code} {resp.text[:200]}")
        return
    data = resp.json()
    if len(data["choices"]) != n or any(c["finish_reason"] not in ("stop", "length") for c in data["choices"]):
        tally.fail(f"completion: bad choices {data['choices']}")
    tally.outcomes["completed"] += 1


async def stream(client: httpx.AsyncClient, rng: random.Random, tally: Tally, *, hang_up: bool) -> None:
    chat = rng.random() < 0.4
    n = rng.choice([1, 2])
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randrange(4, 24), "n": n,
                            "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt(rng)}]
    else:
        body["prompt"] = prompt(rng)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    events: list[Any] = []
    cut_after = rng.randrange(1, 4)
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            tally.fail(f"stream: {resp.status_code} {(await resp.aread())[:200]!r}")
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            if hang_up and len(events) >= cut_after:
                tally.outcomes["client hung up"] += 1
                return  # leaving the block closes the connection mid-stream
    if events[-1:] != ["[DONE]"] or any(isinstance(e, dict) and "error" in e for e in events):
        tally.fail(f"stream: did not end cleanly: {events[-3:]}")
        return
    finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c.get("finish_reason")]
    if sorted(finishes) != sorted(f for f in finishes if f in ("stop", "length")) or len(finishes) != n:
        tally.fail(f"stream: finish reasons {finishes} for n={n}")
    tally.outcomes["streamed"] += 1


async def impatient(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    """A non-streaming client that gives up before the answer comes."""
    body = {"model": MODEL, "prompt": prompt(rng), "max_tokens": 64, "ignore_eos": True}
    try:
        resp = await client.post("/v1/completions", json=body, timeout=rng.uniform(0.05, 0.5))
    except httpx.TimeoutException:
        tally.outcomes["client gave up"] += 1
        return
    if resp.status_code != 200:
        tally.fail(f"impatient: {resp.status_code} {resp.text[:200]}")
    tally.outcomes["completed"] += 1


async def beam(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    """Beam search: all beams run as one unit; a search whose beams could not
    fit the pool together is refused up front (400), never left waiting."""
    best_of = rng.choice([2, 3])
    body = {"model": MODEL, "prompt": prompt(rng), "max_tokens": rng.randrange(4, 16),
            "use_beam_search": True, "best_of": best_of, "n": rng.randrange(1, best_of + 1)}
    resp = await client.post("/v1/completions", json=body)
    if resp.status_code == 400 and "beam search of width" in resp.text:
        tally.outcomes["beam search too big for the pool"] += 1
        return
    if resp.status_code != 200:
        tally.fail(f"beam: {resp.status_code} {resp.text[:200]}")
        return
    choices = resp.json()["choices"]
    if len(choices) != body["n"] or any(c["finish_reason"] not in ("stop", "length") for c in choices):
        tally.fail(f"beam: bad choices {choices}")
    tally.outcomes["beam searches"] += 1


async def long_forks(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    """Issue 28's hybrid case: ``n=3`` long generations outgrow the pool, so
    forks are preempted late and must come back holding only a window in
    the sliding groups."""
    body = {"model": MODEL, "prompt": f"question {rng.randrange(10**6)}", "n": 3,
            "max_tokens": rng.randrange(60, 120), "ignore_eos": True}
    resp = await client.post("/v1/completions", json=body)
    if resp.status_code != 200:
        tally.fail(f"long forks: {resp.status_code} {resp.text[:200]}")
        return
    choices = resp.json()["choices"]
    if len(choices) != 3 or any(c["finish_reason"] != "length" for c in choices):
        tally.fail(f"long forks: bad choices {choices}")
    tally.outcomes["long forks"] += 1


async def bad(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    body = rng.choice(BAD_BODIES)
    if isinstance(body, str):
        resp = await client.post("/v1/completions", content=body,
                                 headers={"content-type": "application/json"})
    else:
        resp = await client.post("/v1/completions", json={"model": MODEL, **body})
    if not 400 <= resp.status_code < 500:
        tally.fail(f"bad request {str(body)[:80]}: got {resp.status_code}")
    tally.outcomes["rejected"] += 1


async def client_loop(url: str, seed: int, until: float, tally: Tally, forks: float = 0.0) -> None:
    """Random requests until ``until``; a share ``forks`` of them are ``long_forks``."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < until:
            roll = rng.random()
            try:
                if rng.random() < forks:
                    await long_forks(client, rng, tally)
                elif roll < 0.22:
                    await completion(client, rng, tally)
                elif roll < 0.3:
                    await beam(client, rng, tally)
                elif roll < 0.6:
                    await stream(client, rng, tally, hang_up=False)
                elif roll < 0.75:
                    await stream(client, rng, tally, hang_up=True)
                elif roll < 0.85:
                    await impatient(client, rng, tally)
                else:
                    await bad(client, rng, tally)
            except Exception as exc:  # a well-formed request must not fail at all
                tally.fail(f"client {seed}: {type(exc).__name__}: {exc}")


def hybrid_model(tmp_path: Any) -> str:
    """A tiny random Gemma 3 (sliding, full, sliding, sliding layers; window
    16) with the default model's tokenizer and chat template."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from paged_server.default_model import ensure_default_model

    tokenizer_dir = ensure_default_model()
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        max_position_embeddings=MAX_SEQ_LEN, query_pre_attn_scalar=16, eos_token_id=2,
        bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path / "gemma3-hybrid"
    Gemma3ForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((tokenizer_dir / name).read_bytes())
    return str(path)


def test_soak_mixed_load_under_constant_preemption(tmp_path) -> None:
    hybrid_dir = hybrid_model(tmp_path)  # before counting threads: saving starts tqdm's monitor
    threads_before = {t.ident for t in threading.enumerate()}
    srv = start_server(num_gpu_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_batch_size=16,
                       max_num_batched_tokens=256)
    # 4 KV cache groups share 39 blocks: a sequence of ~150 tokens holds 10 + 3 x 2.
    hybrid = start_server(model=hybrid_dir, num_gpu_blocks=40,
                          block_size=BLOCK_SIZE, max_batch_size=8, max_num_batched_tokens=256)
    servers = (srv, hybrid)
    try:
        tasks_idle = server_tasks(srv)
        tally = Tally()

        async def load(seconds: float) -> None:
            until = time.monotonic() + seconds
            await asyncio.gather(
                *(client_loop(srv.url, i, until, tally) for i in range(CLIENTS)),
                *(client_loop(hybrid.url, 1000 + i, until, tally, forks=0.3) for i in range(HYBRID_CLIENTS)),
            )

        asyncio.run(load(WARM_UP_S))
        for s in servers:
            wait_idle(s, timeout=60)
        rss_warm = rss_bytes()
        asyncio.run(load(SECONDS - WARM_UP_S))
        metrics, hybrid_metrics = (wait_idle(s, timeout=60) for s in servers)
        rss_end = rss_bytes()

        assert not tally.failures, f"{len(tally.failures)} failures, first: {tally.failures[:5]}"
        done = tally.outcomes["completed"] + tally.outcomes["streamed"]
        assert done > 0 and tally.outcomes["client hung up"] > 0 and tally.outcomes["rejected"] > 0
        assert tally.outcomes["beam searches"] > 0 and tally.outcomes["long forks"] > 0
        assert metrics["num_preemptions_total"] > 0, "the pool was never short"
        assert hybrid_metrics["num_preemptions_total"] > 0, "the hybrid pool was never short"
        assert hybrid.engine.capacity.num_groups == 4
        for s, m in ((srv, metrics), (hybrid, hybrid_metrics)):
            health = httpx.get(s.url + "/health", timeout=30)
            assert health.status_code == 200 and health.json() == {"status": "ok", "audit": []}
            assert s.engine.audit() == []
            assert m["kv_cache_usage_perc"] == 0.0
        growth = rss_end - rss_warm
        assert growth <= RSS_MARGIN_BYTES, (
            f"RSS grew {growth / 2**20:.0f} MiB after warm-up (margin {RSS_MARGIN_BYTES / 2**20:.0f})"
        )
        deadline = time.monotonic() + 10  # closed connections finish their tasks shortly
        while server_tasks(srv) > tasks_idle and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server_tasks(srv) <= tasks_idle
        print(f"soak {SECONDS:.0f}s: {dict(tally.outcomes)}; preemptions "
              f"{metrics['num_preemptions_total']:.0f} (hybrid model: "
              f"{hybrid_metrics['num_preemptions_total']:.0f}); RSS {rss_warm / 2**20:.0f} -> "
              f"{rss_end / 2**20:.0f} MiB")
    finally:
        for s in servers:
            s.stop()
    leftover = [t for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()]
    assert not leftover, f"threads left behind: {[t.name for t in leftover]}"
