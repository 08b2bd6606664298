"""`serve --speculative-config` over HTTP with the real openai client: every
greedy answer is the default server's, token for token, streamed or not;
structured output falls back to plain decoding; /metrics and the stats
line count drafts with vLLM's names (prefix paged:). A draft model (the
served model itself as its own draft) gives the same answers, every draft
kept."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from paged_server.default_model import ensure_default_model
from paged_server.entrypoints.cli import build_parser
from paged_server.entrypoints.openai.engine_args import engine_config_from_args

from .conftest import MODEL, start_server, wait_idle

pytestmark = pytest.mark.e2e

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# A prompt that repeats itself: prompt lookup has something to copy.
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"


@pytest.fixture(scope="module")
def spec_server() -> Iterator[Any]:
    srv = start_server(speculative_config=SPEC)
    yield srv
    srv.stop()


def _text(client: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[str, str | None]:
    if not stream:
        choice = client.completions.create(model=MODEL, **kwargs).choices[0]
        return choice.text, choice.finish_reason
    text, reason = "", None
    for chunk in client.completions.create(model=MODEL, stream=True, **kwargs):
        for c in chunk.choices:
            text += c.text
            reason = c.finish_reason or reason
    return text, reason


def _metric(page: str, name: str) -> float:
    found = re.search(rf"^paged:{name}\{{[^}}]*\}} (\S+)$", page, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def test_greedy_answers_are_the_default_servers(client: openai.OpenAI, spec_server: Any) -> None:
    spec = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    cases: list[dict[str, Any]] = [
        dict(prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}),
        dict(prompt=PROMPT, max_tokens=40, temperature=0, logprobs=2, extra_body={"ignore_eos": True}),
        dict(prompt=PROMPT, max_tokens=30, temperature=0, stop=["\n\n"]),
    ]
    for kwargs in cases:
        for stream in (False, True):
            assert _text(spec, stream, **kwargs) == _text(client, stream, **kwargs), (kwargs, stream)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    chat = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=30,
                temperature=0, response_format=fmt)  # fmt: skip
    want = client.chat.completions.create(**chat).choices[0].message.content
    assert spec.chat.completions.create(**chat).choices[0].message.content == want
    page = httpx.get(spec_server.url + "/metrics").text
    drafts = _metric(page, "spec_decode_num_draft_tokens_total")
    kept = _metric(page, "spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < kept <= drafts
    assert _metric(page, "spec_decode_num_drafts_total") > 0
    assert "spec_decode_num_accepted_tokens_per_pos" in page
    assert wait_idle(spec_server)["kv_cache_usage_perc"] == 0.0
    assert spec_server.engine.audit() == []


def test_the_flag_takes_vllms_json() -> None:
    args = build_parser().parse_args(["serve", "--speculative-config", json.dumps(SPEC)])
    assert engine_config_from_args(args).speculative_config == SPEC
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", "{not json"])


def test_a_draft_model_gives_the_default_servers_answers(client: openai.OpenAI) -> None:
    draft = {"model": str(ensure_default_model()), "num_speculative_tokens": 3}
    args = build_parser().parse_args(["serve", "--speculative-config", json.dumps(draft)])
    assert engine_config_from_args(args).speculative_config == draft
    srv = start_server(speculative_config=draft)
    try:
        spec = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        kwargs: dict[str, Any] = dict(prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
        for stream in (False, True):
            assert _text(spec, stream, **kwargs) == _text(client, stream, **kwargs), stream
        page = httpx.get(srv.url + "/metrics").text
        drafts = _metric(page, "spec_decode_num_draft_tokens_total")
        assert drafts > 0 and _metric(page, "spec_decode_num_accepted_tokens_total") == drafts
        assert wait_idle(srv)["kv_cache_usage_perc"] == 0.0
    finally:
        srv.stop()
