"""The engine thread: one thread touches the engine, outputs reach the right
queue, aborts and failures close streams, and the event loop never waits for
a step."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from paged_server.entrypoints.openai import async_engine
from paged_server.entrypoints.openai.async_engine import AsyncEngine, EngineDeadError, StreamEnd
from paged_server.entrypoints.openai.metrics import ServerMetrics
from paged_server.sampling_params import SamplingParams


async def drain(q: asyncio.Queue[Any], choices: int = 1, timeout: float = 10.0) -> tuple[list[Any], StreamEnd | None]:
    outs: list[Any] = []
    finished = 0
    while finished < choices:
        item = await asyncio.wait_for(q.get(), timeout)
        if isinstance(item, StreamEnd):
            return outs, item
        outs += item
        finished += sum(o.finished for o in item)
    return outs, None


async def add(ae: AsyncEngine, rid: str, prompt: list[int], max_tokens: int, n: int = 1) -> asyncio.Queue[Any]:
    q: asyncio.Queue[Any] = asyncio.Queue()
    await ae.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, n=n), q,
                         arrival=time.monotonic(), num_choices=n)
    return q


def test_outputs_are_routed_per_request_from_one_engine_thread(fake_engine: Any) -> None:
    metrics = ServerMetrics("m")
    ae = AsyncEngine(fake_engine, metrics)
    ae.start()

    async def main() -> None:
        qs = [await add(ae, f"r{i}", [5] * (i + 1), max_tokens=3 + i, n=1 + i % 2) for i in range(6)]
        for i, q in enumerate(qs):
            outs, end = await drain(q, choices=1 + i % 2)
            assert end is None
            assert {o.request_id for o in outs} == {f"r{i}"}
            for choice in range(1 + i % 2):
                text = "".join(o.new_text for o in outs if o.index == choice)
                assert text == fake_engine.expected_text(i + 1, 3 + i, choice)

    try:
        asyncio.run(main())
    finally:
        ae.stop()
    assert len(fake_engine.thread_ids) == 1
    assert threading.get_ident() not in fake_engine.thread_ids
    assert metrics.sample("time_to_first_token_seconds_count") == 6
    assert metrics.num_finished("length") == 6  # requests (9 choices), as vLLM counts


def test_abort_stops_generation_and_is_counted(fake_engine: Any) -> None:
    fake_engine.step_delay = 0.01
    metrics = ServerMetrics("m")
    ae = AsyncEngine(fake_engine, metrics)
    ae.start()

    async def main() -> None:
        q = await add(ae, "long", [1, 2], max_tokens=250)
        await asyncio.wait_for(q.get(), 5)  # it is running
        ae.abort("long")
        deadline = time.monotonic() + 5
        while "long" not in fake_engine.aborted and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
    finally:
        ae.stop()
    assert fake_engine.aborted == ["long"]
    assert not fake_engine.requests
    assert metrics.num_finished("abort") == 1


def test_failed_step_ends_in_flight_streams_and_engine_keeps_serving(fake_engine: Any) -> None:
    ae = AsyncEngine(fake_engine)
    ae.start()

    async def main() -> None:
        fake_engine.fail_steps = 1
        q = await add(ae, "doomed", [1], max_tokens=5)
        _, end = await drain(q)
        assert end is not None and end.reason == "error"
        assert "scripted step failure" in end.message
        q2 = await add(ae, "fine", [1], max_tokens=2)  # the next request works
        outs, end2 = await drain(q2)
        assert end2 is None and outs[-1].finished

    try:
        asyncio.run(main())
    finally:
        ae.stop()
    assert ae.step_errors == 1
    assert "doomed" in fake_engine.aborted


def test_stop_closes_streams_and_refuses_new_work(fake_engine: Any) -> None:
    fake_engine.step_delay = 0.01
    ae = AsyncEngine(fake_engine)
    ae.start()

    async def main() -> None:
        q = await add(ae, "inflight", [1], max_tokens=250)
        await asyncio.wait_for(q.get(), 5)
        await asyncio.to_thread(ae.stop)
        _, end = await drain(q)
        assert end is not None and end.reason == "abort"
        with pytest.raises(EngineDeadError):
            await add(ae, "late", [1], max_tokens=1)

    asyncio.run(main())
    assert "inflight" in fake_engine.aborted
    assert not fake_engine.requests


def test_event_loop_keeps_running_during_a_slow_step(fake_engine: Any) -> None:
    fake_engine.step_delay = 0.3
    ae = AsyncEngine(fake_engine)
    ae.start()

    async def main() -> float:
        q = await add(ae, "slow", [1], max_tokens=3)
        worst, last = 0.0, time.monotonic()
        consumer = asyncio.create_task(drain(q))
        while not consumer.done():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            worst, last = max(worst, now - last), now
        await consumer
        return worst

    try:
        worst_gap = asyncio.run(main())
    finally:
        ae.stop()
    assert fake_engine.steps >= 3
    assert worst_gap < 0.25, f"event loop stalled for {worst_gap:.3f} s while a 0.3 s step ran"


def test_a_step_wakes_the_event_loop_once_whatever_the_streams(fake_engine: Any) -> None:
    """Every stream's output of a step arrives in one hand-off to the event
    loop: a wake-up per stream made the engine thread wait for the HTTP
    thread once per request, every step."""
    fake_engine.step_delay = 0.002
    ae = AsyncEngine(fake_engine)
    ae.start()

    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        handoffs: list[int] = []
        plain = loop.call_soon_threadsafe

        def counted(callback: Any, *args: Any, **kwargs: Any) -> Any:
            handoffs.append(fake_engine.steps)
            return plain(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        qs = [await add(ae, f"r{i}", [5], max_tokens=40) for i in range(8)]
        handoffs.clear()
        first_step = fake_engine.steps
        for q in qs:
            outs, end = await drain(q)
            assert end is None and sum(len(o.new_token_ids) > 0 for o in outs) == 40
        return len(handoffs), fake_engine.steps - first_step

    try:
        handoffs, steps = asyncio.run(main())
    finally:
        ae.stop()
    assert steps >= 30  # most of the 8 x 40 tokens came after the last add
    assert handoffs <= steps + 1, f"{handoffs} hand-offs to the event loop in {steps} steps of 8 streams"


def test_a_steps_outputs_are_taken_before_the_next_step_starts(
    fake_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine thread waits for the event loop to run the streams a step
    woke before it steps again: a compiled forward holds the GIL, so a
    delivery left pending waits for the next step to end. Each step's token
    then reaches its stream while the engine still counts that step (no
    bound on the wait here, so a slow loop cannot fail it)."""
    monkeypatch.setattr(async_engine, "HANDOFF_WAIT_S", 30.0)
    ae = AsyncEngine(fake_engine)
    ae.start()

    async def main() -> list[int]:
        q = await add(ae, "r", [5], max_tokens=60)
        seen: list[int] = []
        while True:
            item = await q.get()  # as a stream awaits it (no wait_for: a task between)
            seen += [fake_engine.steps] * len(item)  # one output per step
            if any(o.finished for o in item):
                return seen

    try:
        seen = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        ae.stop()
    assert len(seen) == 60
    assert seen == list(range(seen[0], seen[0] + 60)), f"tokens reached the stream at steps {seen}"


def test_a_stalled_event_loop_holds_each_step_at_most_the_hand_off_wait(fake_engine: Any) -> None:
    """The wait is bounded: while the loop is blocked, the engine keeps
    stepping, each step waiting ``HANDOFF_WAIT_S`` at most."""
    ae = AsyncEngine(fake_engine)
    ae.start()

    async def main() -> tuple[int, int]:
        q = await add(ae, "r", [5], max_tokens=250)
        await asyncio.wait_for(q.get(), 10)
        before = fake_engine.steps
        time.sleep(0.2)  # blocks this loop: nothing is delivered meanwhile
        return before, fake_engine.steps

    try:
        before, after = asyncio.run(main())
    finally:
        ae.stop()
    assert after - before >= 0.2 / async_engine.HANDOFF_WAIT_S / 4, (
        f"{after - before} steps in 0.2 s while the event loop was blocked"
    )


def test_only_a_cpu_engine_waits_for_the_event_loop(fake_engine: Any) -> None:
    """A GPU's forward leaves the GIL free, so the loop writes meanwhile:
    waiting there would only idle the device."""
    for device, wait in (("cpu", async_engine.HANDOFF_WAIT_S), ("cuda", 0.0), ("cuda:1", 0.0)):
        fake_engine.config = SimpleNamespace(device=device)
        assert AsyncEngine(fake_engine).handoff_wait_s == wait, device


def test_add_errors_propagate_to_the_caller(fake_engine: Any) -> None:
    ae = AsyncEngine(fake_engine)
    ae.start()

    async def main() -> None:
        with pytest.raises(ValueError, match="max_tokens"):
            await add(ae, "bad", [1], max_tokens=10**9)

    try:
        asyncio.run(main())
    finally:
        ae.stop()


class _DeferredAnswers:
    """Wraps a fake engine the way data parallelism answers adds: a future
    resolved by the next step (a replica's reply), failing as the add would."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.unanswered: list[tuple[concurrent.futures.Future[int], Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add_request(self, request_id: str, prompt: Any, params: Any) -> concurrent.futures.Future[int]:
        answer: concurrent.futures.Future[int] = concurrent.futures.Future()
        answer.set_running_or_notify_cancel()
        self.unanswered.append((answer, lambda: self.engine.add_request(request_id, prompt, params)))
        return answer

    def has_unfinished(self) -> bool:
        return bool(self.unanswered) or self.engine.has_unfinished()

    def step(self) -> list[Any]:
        for answer, add in self.unanswered:
            try:
                answer.set_result(add())
            except Exception as exc:
                answer.set_exception(exc)
        self.unanswered = []
        return self.engine.step() if self.engine.has_unfinished() else []


def test_an_add_answered_by_a_later_step_is_awaited_and_its_error_raised(fake_engine: Any) -> None:
    engine = _DeferredAnswers(fake_engine)
    ae = AsyncEngine(engine)
    ae.start()

    async def main() -> None:
        q = await add(ae, "ok", [5, 5], max_tokens=3)
        outs, end = await drain(q)
        assert end is None and "".join(o.new_text for o in outs) == fake_engine.expected_text(2, 3, 0)
        with pytest.raises(ValueError, match="prompt: must not be empty"):
            await add(ae, "bad", [], max_tokens=3)
        assert await ae.call(lambda: "bad" not in ae._tracked)  # a failed add is not tracked

    try:
        asyncio.run(main())
    finally:
        ae.stop()
