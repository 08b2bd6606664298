"""Priority scheduling over real HTTP (vLLM's ``--scheduling-policy priority``
and the request field ``priority``), with the ``openai`` client passing it
in ``extra_body``: on a server with one running place, a priority-0 request
sent last is answered while the priority-10 ones sent before it still run;
under fcfs (the default) a nonzero priority is a 400 on completions, chat
and responses, as vLLM refuses it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from paged_server.entrypoints.openai.server import ServerThread

from .conftest import MODEL, start_server, wait_idle

pytestmark = pytest.mark.e2e

CHAT = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def by_priority() -> Iterator[ServerThread]:
    srv = start_server(max_batch_size=1, scheduling_policy="priority")
    yield srv
    srv.stop()


def _wait_waiting(server: ServerThread, count: int) -> None:
    deadline = time.monotonic() + 30
    while server.async_engine.metrics()["num_requests_waiting"] < count:
        assert time.monotonic() < deadline, server.async_engine.metrics()
        time.sleep(0.01)


def test_a_priority_0_request_sent_last_is_answered_before_the_priority_10_ones(
    by_priority: ServerThread,
) -> None:
    client = openai.OpenAI(base_url=by_priority.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    low = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 120, "temperature": 0,
           "extra_body": {"priority": 10, "ignore_eos": True}}  # fmt: skip
    done: dict[str, float] = {}
    texts: dict[str, str] = {}

    def streamed() -> None:  # holds the only running place first
        text = ""
        for chunk in client.completions.create(stream=True, **low):
            text += chunk.choices[0].text if chunk.choices else ""
            started.set()
        texts["low0"], done["low0"] = text, time.monotonic()

    def queued() -> None:
        texts["low1"] = client.completions.create(**low).choices[0].text
        done["low1"] = time.monotonic()

    started = threading.Event()
    threads = [threading.Thread(target=streamed)]
    threads[0].start()
    assert started.wait(60)
    threads.append(threading.Thread(target=queued))
    threads[1].start()
    _wait_waiting(by_priority, 1)
    urgent = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0,
                                       extra_body={"priority": 0, "ignore_eos": True})
    done["urgent"] = time.monotonic()
    for t in threads:
        t.join(120)
    assert urgent.choices[0].finish_reason == "length"
    assert done["urgent"] < done["low0"] < done["low1"]  # low0 was preempted for it, then resumed
    assert texts["low0"] == texts["low1"]  # the preempted one's greedy text is the undisturbed one's
    assert by_priority.engine.counters.preemptions >= 1
    wait_idle(by_priority)
    assert by_priority.engine.audit() == []


def test_chat_and_responses_take_a_priority(by_priority: ServerThread) -> None:
    with httpx.Client(base_url=by_priority.url, timeout=60) as http:
        for path, body in (("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "priority": -3}),
                           ("/v1/responses", {"input": "Hello", "max_output_tokens": 2, "priority": 7})):
            resp = http.post(path, json=body)
            assert resp.status_code == 200, (path, resp.text)


def test_fcfs_refuses_a_nonzero_priority_with_a_400(http: httpx.Client) -> None:
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
                       ("/v1/responses", {"input": "x", "max_output_tokens": 1})):
        resp = http.post(path, json={**body, "priority": 5})
        assert resp.status_code == 400, (path, resp.text)
        err = resp.json()["error"]
        assert err["param"] == "priority", err
        assert err["message"].startswith("priority: got 5 but priority scheduling is not enabled"), err
        assert "--scheduling-policy priority" in err["message"]
        assert http.post(path, json={**body, "priority": 0}).status_code == 200
