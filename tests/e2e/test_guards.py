"""Queue-full back-pressure (503 + Retry-After), the API key (401) and n above
the batch limit (400), on a server with one running seq_id, a one-request queue
and a key."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from paged_server.entrypoints.openai.app import ServerSettings
from paged_server.entrypoints.openai.server import ServerThread

from .conftest import MODEL, start_server, wait_idle

pytestmark = pytest.mark.e2e

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded() -> Iterator[ServerThread]:
    srv = start_server(ServerSettings(model_name=MODEL, api_key=KEY, shutdown_timeout_s=2),
                       max_batch_size=1, max_num_batched_tokens=256, max_queue_len=1)
    yield srv
    srv.stop()


def test_full_queue_answers_503_with_retry_after(guarded: ServerThread) -> None:
    long = {"prompt": "a long story", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=long) as running:
            lines = running.iter_lines()
            next(lines)  # the first request holds the only batch seq_id
            with client.stream("POST", "/v1/completions", json=long) as queued:
                assert queued.status_code == 200  # accepted into the one-place queue
                resp = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                assert resp.status_code == 503
                assert resp.headers["retry-after"] == "1"
                err = resp.json()["error"]
                assert err["code"] == "queue_full"
                assert "max_queue_len 1" in err["message"] and "retry" in err["message"]
        wait_idle(guarded)  # both streams hung up: aborted, capacity back
        ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200
    assert guarded.engine.audit() == []


def test_n_above_max_batch_size_is_400_and_does_not_block_the_queue(guarded: ServerThread) -> None:
    """n choices run at once: n=2 on a one-place server could never start and,
    queued, held up every request behind it. It must be refused up front."""
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=20) as client:
        for path, body in [("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})]:
            resp = client.post(path, json={**body, "n": 2, "max_tokens": 1})
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["param"] == "n"
            assert err["message"].startswith("n: must be <= 1 (max_batch_size), got 2")
        ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": 1})
        assert ok.status_code == 200
    wait_idle(guarded)
    assert guarded.engine.audit() == []


def test_api_key_is_required_everywhere_but_health(guarded: ServerThread) -> None:
    url = guarded.url
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200  # open by default, as vLLM's
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions")]:
        resp = httpx.request(method, url + path, json={"prompt": "x"})
        assert resp.status_code == 401, path
        err = resp.json()["error"]
        assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="x", max_tokens=1)
    right = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    out: Any = right.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert out.usage.completion_tokens >= 1
