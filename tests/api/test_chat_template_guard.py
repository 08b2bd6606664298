"""A chat template never stops the server (issue 53, item 4): a request's
template is refused unless the server trusts them (vLLM's
--trust-request-chat-template); every template renders off the event loop,
sandboxed, and one that runs past its time budget is a 400 and is stopped.
Real HTTP server on loopback, real tokenizer, scripted engine."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from paged_server.entrypoints.openai.app import ServerSettings
from paged_server.entrypoints.openai.server import ServerThread

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# 99,999 x 99,999 empty iterations: hours of pure-Python work.
ENDLESS = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}x"


def _server(engine: Any, **settings: Any) -> ServerThread:
    return ServerThread(engine, ServerSettings(model_name="fake-model", shutdown_timeout_s=2, **settings))


def _render_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "chat-template"]


def test_a_runaway_template_is_a_400_and_health_answers_meanwhile(make_fake_engine: Any) -> None:
    with _server(make_fake_engine(), trust_request_chat_template=True, chat_template_timeout_s=1.5) as srv:
        answer: dict[str, Any] = {}

        def chat() -> None:
            start = time.monotonic()
            resp = httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "chat_template": ENDLESS},
                              timeout=60)
            answer["resp"], answer["seconds"] = resp, time.monotonic() - start

        caller = threading.Thread(target=chat)
        caller.start()
        # Wait for the render to start (it then runs for the 1.5 s budget): polled,
        # not slept, so a busy machine's slower request is not a failure.
        deadline = time.monotonic() + 20
        while not _render_threads() and caller.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _render_threads(), "the template is not rendering on a thread of its own"
        health = [httpx.get(srv.url + "/health", timeout=10).status_code for _ in range(5)]
        assert health == [200] * 5
        caller.join(30)
        resp = answer["resp"]
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "chat_template" and "longer than 1.5 s" in err["message"], err
        assert answer["seconds"] < 10  # the budget, not the loop, ended it
        # The render itself was stopped, not left burning a core.
        deadline = time.monotonic() + 5
        while _render_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _render_threads()
        # The server's own template still renders, and the server still serves.
        ok = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert ok.status_code == 200, ok.text


def test_request_templates_need_the_trust_flag(fake_server: Any) -> None:
    for body in ({**CHAT, "chat_template": "{{ messages[0].content }}"},
                 {**CHAT, "chat_template_kwargs": {"chat_template": "{{ messages[0].content }}"}}):
        resp = httpx.post(fake_server.url + "/v1/chat/completions", json=body, timeout=30)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]
    assert httpx.post(fake_server.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


def test_template_failures_are_400s_that_name_the_template(make_fake_engine: Any) -> None:
    engine = make_fake_engine()
    with _server(engine, trust_request_chat_template=True) as srv:
        cases = {
            "{% include 'secrets.txt' %}": "cannot include",
            "{% for i in range(100000000) %}{% endfor %}": "Range too big",
            "{{ 'x' * 1000000000 }}": "past the limit",
            "{{ 9 ** 99999999 }}": "bits",
            "{% for m in messages %}": "not a valid Jinja template (line 1)",
            "{{ messages[0].content.nope() }}": "failed",
        }
        for template, what in cases.items():
            resp = httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "chat_template": template},
                              timeout=30)
            assert resp.status_code == 400, (template, resp.text)
            err = resp.json()["error"]
            assert err["param"] == "chat_template" and what in err["message"], (template, err)
            assert err["message"].startswith("chat_template: "), err
        # a template variable named like a render argument is only a variable
        body = {**CHAT, "chat_template": "{{ tokenize }}|{{ messages[0].content }}",
                "chat_template_kwargs": {"tokenize": "yes"}}
        resp = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)
        assert resp.status_code == 200, resp.text
        want = engine.tokenizer.encode("yes|hi", add_special_tokens=False)
        assert resp.json()["usage"]["prompt_tokens"] == len(want)


def test_the_models_template_rejecting_messages_names_them(make_fake_engine: Any) -> None:
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    with _server(make_fake_engine(), chat_template=template) as srv:
        resp = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                          json={"messages": [{"role": "assistant", "content": "x"}]})
        assert resp.status_code == 400
        err = resp.json()["error"]
        assert err["param"] == "messages" and "first must be user" in err["message"], err
