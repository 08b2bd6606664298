"""The HTTP layer on a real uvicorn server around the scripted engine: SSE
framing, choice numbering, guards, queue-full, disconnects."""

from __future__ import annotations

import gc
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from paged_server.entrypoints.openai.app import ServerSettings
from paged_server.entrypoints.openai.server import ServerThread

pytestmark = pytest.mark.e2e


def sse_events(resp: httpx.Response) -> list[str]:
    """The data payloads of an SSE response, asserting the framing."""
    assert resp.headers["content-type"].startswith("text/event-stream")
    blocks = resp.text.split("\n\n")
    assert blocks[-1] == "", "stream must end with a blank line"
    payloads = []
    for block in blocks[:-1]:
        assert block.startswith("data: "), block
        payloads.append(block[len("data: "):])
    return payloads


def test_completion_stream_framing_and_usage(fake_server: Any, fake_engine: Any) -> None:
    body = {"prompt": [7, 8, 9], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    resp = httpx.post(fake_server.url + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200
    payloads = sse_events(resp)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    text_chunks = chunks[:-1]
    assert all(c["usage"] is None for c in text_chunks)
    assert all(c["object"] == "text_completion" and c["id"] == usage_chunk["id"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == fake_engine.expected_text(3, 4)
    assert [c["choices"][0]["finish_reason"] for c in text_chunks] == [None, None, None, "length"]


def test_several_prompts_times_n_number_choices_like_openai(fake_server: Any, fake_engine: Any) -> None:
    body = {"prompt": [[1], [1, 2, 3]], "n": 2, "max_tokens": 3}
    resp = httpx.post(fake_server.url + "/v1/completions", json=body, timeout=30).json()
    texts = {c["index"]: c["text"] for c in resp["choices"]}
    assert texts == {
        0: fake_engine.expected_text(1, 3, 0), 1: fake_engine.expected_text(1, 3, 1),
        2: fake_engine.expected_text(3, 3, 0), 3: fake_engine.expected_text(3, 3, 1),
    }
    assert resp["usage"] == {"prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_stream_opens_with_role_and_closes_with_finish(fake_server: Any) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    resp = httpx.post(fake_server.url + "/v1/chat/completions", json=body, timeout=30)
    chunks = [json.loads(p) for p in sse_events(resp)[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_chunked_body_over_the_limit_is_413(fake_engine: Any) -> None:
    settings = ServerSettings(model_name="fake-model", max_body_bytes=1000)

    def body() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 200
        yield b'"}'

    with ServerThread(fake_engine, settings) as srv:
        resp = httpx.post(srv.url + "/v1/completions", content=body(),
                          headers={"content-type": "application/json"}, timeout=30)
        assert resp.status_code == 413
        assert "limit of 1000 bytes" in resp.json()["error"]["message"]
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
        assert ok.status_code == 200


def test_queue_full_is_503_with_retry_after(make_fake_engine: Any) -> None:
    engine = make_fake_engine(max_running=1, max_queue_len=1, step_delay=0.01)
    with ServerThread(engine, ServerSettings(model_name="fake-model", shutdown_timeout_s=1)) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as client:
        long = {"prompt": "x", "max_tokens": 200, "stream": True}
        with client.stream("POST", "/v1/completions", json=long) as running:
            lines = running.iter_lines()  # keep the iterator: dropping it closes the stream
            next(lines)  # the first request is running
            with client.stream("POST", "/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200  # accepted, queued
                resp = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                assert resp.status_code == 503
                assert resp.headers["retry-after"] == "1"
                err = resp.json()["error"]
                assert "busy" in err["message"] and err["code"] == "queue_full"
        deadline = time.monotonic() + 10
        while engine.requests and time.monotonic() < deadline:  # both aborted on disconnect
            time.sleep(0.02)
        assert not engine.requests
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_client_disconnect_aborts_the_request(make_fake_engine: Any) -> None:
    engine = make_fake_engine(step_delay=0.01)
    with ServerThread(engine, ServerSettings(model_name="fake-model")) as srv:
        with httpx.Client(base_url=srv.url, timeout=30) as client, client.stream(
            "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 250, "stream": True}
        ) as resp:
            lines = resp.iter_lines()
            next(lines)
            next(lines)
        deadline = time.monotonic() + 10
        while not engine.aborted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(engine.aborted) == 1
        assert not engine.requests


def test_non_streaming_client_that_gives_up_is_aborted(make_fake_engine: Any) -> None:
    engine = make_fake_engine(step_delay=0.01)
    with ServerThread(engine, ServerSettings(model_name="fake-model")) as srv:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 250}, timeout=0.3)
        deadline = time.monotonic() + 10  # noticed at the next disconnect poll (1 s)
        while not engine.aborted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(engine.aborted) == 1
        assert not engine.requests


def test_api_key_in_anthropics_header(fake_engine: Any) -> None:
    """``x-api-key`` (what Anthropic's client sends) is as good as a Bearer
    token, on every guarded path; a wrong one is a 401 all the same."""
    settings = ServerSettings(model_name="fake-model", api_key="s3cret")
    with ServerThread(fake_engine, settings) as srv:
        ok = httpx.get(srv.url + "/v1/models", headers={"x-api-key": "s3cret"})
        assert ok.status_code == 200
        wrong = httpx.get(srv.url + "/v1/models", headers={"x-api-key": "nope"})
        assert wrong.status_code == 401 and "wrong API key" in wrong.json()["error"]["message"]
        client = anthropic.Anthropic(base_url=srv.url, api_key="s3cret", max_retries=0)
        message = client.messages.create(model="fake-model", max_tokens=3,
                                         messages=[{"role": "user", "content": "hi"}])
        assert message.usage.output_tokens == 3 and message.stop_reason == "max_tokens"
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=srv.url, api_key="nope", max_retries=0).messages.create(
                model="fake-model", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        bearer = httpx.post(srv.url + "/v1/messages", headers={"Authorization": "Bearer s3cret"},
                            json={"model": "fake-model", "max_tokens": 2,
                                  "messages": [{"role": "user", "content": "hi"}]})
        assert bearer.status_code == 200 and bearer.json()["type"] == "message"


def test_api_key_guards_everything_but_probes_and_metrics(fake_engine: Any) -> None:
    settings = ServerSettings(model_name="fake-model", api_key="s3cret")
    with ServerThread(fake_engine, settings) as srv:
        for path in ("/health", "/ping", "/metrics"):  # open, as vLLM's
            assert httpx.get(srv.url + path).status_code == 200, path
        for path in ("/v1/models", "/openapi.json"):
            resp = httpx.get(srv.url + path)
            assert resp.status_code == 401
            assert "missing API key" in resp.json()["error"]["message"]
        wrong = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "wrong API key" in wrong.json()["error"]["message"]
        ok = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "fake-model"
    settings.metrics_need_api_key = True  # --metrics-need-api-key
    with ServerThread(fake_engine, settings) as srv:
        assert httpx.get(srv.url + "/metrics").status_code == 401
        authorized = httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer s3cret"})
        assert authorized.status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "param", "fragment"),
    [
        ("/v1/completions", {"prompt": "x", "use_beam_search": True, "stream": True}, "use_beam_search",
         "send stream=false"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True,
                                  "stream": True}, "use_beam_search", "send stream=false"),
        ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3}, "best_of", "got best_of 3 with n 2"),
    ],
)
def test_unsupported_search_options_are_400_never_ignored(
    fake_server: Any, fake_engine: Any, path: str, body: dict[str, Any], param: str, fragment: str
) -> None:
    """Options the server cannot honour as asked are refused, not ignored."""
    resp = httpx.post(fake_server.url + path, json={**body, "max_tokens": 2}, timeout=30)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param
    assert err["message"].startswith(f"{param}: ") and fragment in err["message"], err["message"]
    assert fake_engine.added == []  # refused before reaching the engine
    off = {**body, "use_beam_search": False, "best_of": None, "max_tokens": 2}
    assert httpx.post(fake_server.url + path, json=off, timeout=30).status_code == 200


def test_a_running_server_freezes_its_start_up_heap(fake_engine: Any) -> None:
    """The objects alive at start-up are frozen while the server runs (the
    collector's full passes skip them) and released when it stops."""
    assert gc.get_freeze_count() == 0
    with ServerThread(fake_engine, ServerSettings(model_name="fake-model")) as srv:
        assert gc.get_freeze_count() > 0
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                          timeout=30).status_code == 200  # fmt: skip
    assert gc.get_freeze_count() == 0


def _seconds_until_closed(sock: socket.socket, limit: float, trickle: bytes = b"") -> float | None:
    """Seconds until the server closes ``sock`` (None: still open after
    ``limit``), sending ``trickle`` a byte every 0.1 s meanwhile (slowloris)."""
    start = time.monotonic()
    sock.settimeout(0.1)
    sent = 0
    while time.monotonic() - start < limit:
        try:
            if sent < len(trickle):
                sock.sendall(trickle[sent:sent + 1])
                sent += 1
            if sock.recv(4096) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except OSError:  # reset: closed too
            return time.monotonic() - start
    return None


def test_a_client_that_never_finishes_its_request_is_closed(fake_engine: Any) -> None:
    """Slowloris: half a head sent slowly, a head with half its body, or
    nothing at all; each is closed once the request-read bound (0.5 s here)
    has passed, while whole requests, kept-alive ones included, still work."""
    settings = ServerSettings(model_name="fake-model", request_read_timeout_s=0.5)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    cases = {
        "half a head, trickled": (head, b"X-Slow: " + b"a" * 60),
        "a head and half its body": (head + b"Content-Length: 100\r\n\r\n" + b'{"prompt": "', b""),
        "nothing": (b"", b""),
    }
    with ServerThread(fake_engine, settings) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        for name, (first, trickle) in cases.items():
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(first)
                took = _seconds_until_closed(sock, limit=5.0, trickle=trickle)
            assert took is not None and 0.3 < took < 3.0, (name, took)
        with httpx.Client(base_url=srv.url, timeout=30) as client:  # one kept-alive connection
            for _ in range(2):
                assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
                time.sleep(0.7)  # idle past the read bound between requests: still served
