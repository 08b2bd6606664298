"""Clients that hang up mid-stream: their requests are aborted and every KV
block comes back."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from paged_server.entrypoints.openai.async_engine import AsyncEngine
from paged_server.entrypoints.openai.server import build_engine
from paged_server.sampling_params import SamplingParams

from .conftest import MODEL, engine_config, wait_idle

pytestmark = pytest.mark.e2e

MAX_TOKENS = 200


def test_20_streams_disconnecting_midway_free_everything(server: Any) -> None:
    metrics = server.app.state.metrics
    aborted_before = metrics.num_finished("abort")
    generated_before = server.async_engine.metrics()["generation_tokens_total"]
    capacity = server.engine.free_token_capacity()

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL, "prompt": f"client {i} says", "max_tokens": MAX_TOKENS,
                "stream": True, "ignore_eos": True}
        events = 0
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events == 3:
                        break  # hang up with the request still generating
        return events

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(20)))

    assert asyncio.run(main()) == [3] * 20
    after = wait_idle(server)
    deadline = time.monotonic() + 10  # aborts are counted when the engine thread runs them
    while metrics.num_finished("abort") - aborted_before < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metrics.num_finished("abort") - aborted_before == 20
    generated = after["generation_tokens_total"] - generated_before
    assert generated < 20 * MAX_TOKENS / 2, f"{generated} tokens: streams were not cut short"
    assert server.engine.audit() == []
    assert server.engine.free_token_capacity() == capacity
    assert after["kv_cache_usage_perc"] == 0.0
    health = httpx.get(server.url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["audit"] == []


def test_abort_frees_blocks_within_one_step() -> None:
    """Directly on the async front: after abort() the very next engine step
    returns the request's KV capacity."""
    engine = build_engine(engine_config())
    capacity = engine.free_token_capacity()
    frees_after_abort: list[int] = []
    real_step = engine.step
    state = {"aborted": False}

    def step() -> Any:
        out = real_step()
        if state["aborted"]:
            frees_after_abort.append(engine.free_token_capacity())
        return out

    engine.step = step  # type: ignore[method-assign]
    ae = AsyncEngine(engine)
    ae.start()

    async def main() -> None:
        q: asyncio.Queue[Any] = asyncio.Queue()
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        await ae.add_request("r", [5] * 40, params, q, arrival=time.monotonic(), num_choices=1)
        for _ in range(3):
            await asyncio.wait_for(q.get(), 30)
        assert await ae.call(engine.free_token_capacity) < capacity
        ae.abort("r")
        # Runs right after the abort, before any further step starts.
        await ae.call(lambda: state.update(aborted=True))
        for _ in range(200):
            if frees_after_abort:
                return
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
    finally:
        ae.stop()
    assert frees_after_abort and frees_after_abort[0] == capacity
