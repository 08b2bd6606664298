"""A forward pass that raises fails only the requests in that step, with the
error's message (HTTP 500 / an error event in a stream); the server keeps
serving the next request and the KV audit stays clean."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from paged_server.entrypoints.openai.server import ServerThread

from .conftest import MODEL, start_server, wait_idle

pytestmark = pytest.mark.e2e


class Fault:
    """Wraps the engine's forward pass: raises once, on the next call after ``arm()``."""

    def __init__(self, engine: Any) -> None:
        self._execute = engine._forward
        self._armed = threading.Event()
        self.fired = 0
        engine._forward = self

    def arm(self) -> None:
        self._armed.set()

    def __call__(self, scheduled: Any) -> Any:
        if self._armed.is_set():
            self._armed.clear()
            self.fired += 1
            raise RuntimeError(f"injected fault in a step of {len(scheduled)} sequence(s)")
        return self._execute(scheduled)


@pytest.fixture(scope="module")
def faulty() -> Iterator[tuple[ServerThread, Fault]]:
    srv = start_server()
    yield srv, Fault(srv.engine)
    srv.stop()


def complete(url: str, **body: Any) -> httpx.Response:
    payload = {"model": MODEL, "prompt": "fault tolerance", "max_tokens": 8, **body}
    return httpx.post(url + "/v1/completions", json=payload, timeout=60)


def test_a_failed_step_is_a_500_with_its_message_and_the_next_request_works(faulty) -> None:
    srv, fault = faulty
    fault.arm()
    failed = complete(srv.url)
    assert fault.fired == 1
    assert failed.status_code == 500
    message = failed.json()["error"]["message"]
    assert "model forward pass failed" in message and "injected fault" in message
    ok = complete(srv.url)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    wait_idle(srv)
    assert httpx.get(srv.url + "/health", timeout=30).json() == {"status": "ok", "audit": []}


def test_a_failed_step_mid_stream_ends_that_stream_with_an_error(faulty) -> None:
    srv, fault = faulty
    body = {"model": MODEL, "prompt": "stream then fail", "max_tokens": 40, "stream": True,
            "ignore_eos": True}
    events: list[Any] = []
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            if len(events) == 2:
                fault.arm()  # the stream is generating: its next step fails
    assert events[-1] == "[DONE]"
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and "injected fault" in errors[0]["error"]["message"]
    finishes = [c["finish_reason"] for e in events if isinstance(e, dict)
                for c in e.get("choices", []) if c.get("finish_reason")]
    assert finishes == ["error"]
    assert complete(srv.url).status_code == 200
    wait_idle(srv)
    assert srv.engine.audit() == []


def test_one_requests_failing_beam_step_spares_a_stream_in_the_same_step(
    faulty, monkeypatch
) -> None:
    """A beam search whose scorer raises (as ``length ** length_penalty``
    did at ~1024: OverflowError) fails with a 500 naming the error; a
    stream generating in the same steps finishes untouched."""
    import paged_server.engine.core.llm_engine as engine_module

    srv, _ = faulty

    def advance(*args: Any) -> bool:
        raise OverflowError("(34, 'Numerical result out of range')")

    monkeypatch.setattr(engine_module, "advance_beams", advance)
    beam: dict[str, httpx.Response] = {}

    def submit_beam() -> None:
        beam["response"] = complete(srv.url, use_beam_search=True, best_of=2, max_tokens=8)

    worker = threading.Thread(target=submit_beam)
    body = {"model": MODEL, "prompt": "a neighbour", "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    events: list[Any] = []
    beam_done_before_stream_end = False
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            if len(events) == 2:
                worker.start()  # the stream is generating: the beam request joins its steps
            if len(events) == 150:
                beam_done_before_stream_end = "response" in beam
    worker.join(60)
    failed = beam["response"]
    assert failed.status_code == 500
    assert "beam search failed: OverflowError" in failed.json()["error"]["message"]
    assert beam_done_before_stream_end
    assert events[-1] == "[DONE]"
    assert not [e for e in events if isinstance(e, dict) and "error" in e]
    finishes = [c["finish_reason"] for e in events if isinstance(e, dict)
                for c in e.get("choices", []) if c.get("finish_reason")]
    assert finishes == ["length"]
    wait_idle(srv)
    assert srv.engine.audit() == []
