"""`serve --async-output-proc` and `serve --async-scheduling` over HTTP with
the real openai client: every response, streamed or not, is what the
default server sends (outputs only arrive a step later)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from .conftest import MODEL, start_server, wait_idle

pytestmark = pytest.mark.e2e

PROMPT = "def main():"


@pytest.fixture(scope="module", params=["async_output_proc", "async_scheduling"])
def async_client(request: pytest.FixtureRequest) -> Iterator[tuple[openai.OpenAI, Any]]:
    srv = start_server(**{request.param: True})
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60), srv
    srv.stop()


def _streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[dict[int, str], dict[int, str], Any]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(model=MODEL, stream=True,
                                           stream_options={"include_usage": True}, **kwargs):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
        usage = chunk.usage or usage
    return texts, reasons, (usage.prompt_tokens, usage.completion_tokens)


def test_responses_match_the_default_server(
    client: openai.OpenAI, async_client: tuple[openai.OpenAI, Any]
) -> None:
    overlapped, srv = async_client
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    stop = next(greedy[p:p + 2] for p in range(len(greedy) // 2, len(greedy) - 1)
                if greedy[p:p + 2].isascii() and greedy[p:p + 2].strip())
    cases: list[dict[str, Any]] = [
        dict(prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}),
        dict(prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
             extra_body={"ignore_eos": True}),
        dict(prompt=PROMPT, max_tokens=12, temperature=0.9, seed=4, n=2,
             extra_body={"ignore_eos": True}),
    ]
    for kwargs in cases:
        want = _streamed(client, **kwargs)
        assert _streamed(overlapped, **kwargs) == want, kwargs
        plain = client.completions.create(model=MODEL, **kwargs)
        got = overlapped.completions.create(model=MODEL, **kwargs)
        assert [(c.text, c.finish_reason) for c in got.choices] == [
            (c.text, c.finish_reason) for c in plain.choices
        ]
        assert got.usage.completion_tokens == plain.usage.completion_tokens
    assert "stop" in _streamed(overlapped, **cases[1])[1].values()
    assert wait_idle(srv)["kv_cache_usage_perc"] == 0.0
    assert srv.engine.audit() == []
