"""/v1/messages through the real server and Anthropic's own client,
unchanged: ``messages.create`` (streamed and not) and ``messages.stream``.
Chat completions are the oracle: a message must be exactly what the chat
request it stands for gives (greedy, so the random-weight model is
deterministic); the grammar makes even that model's tool calls valid."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from paged_server.entrypoints.openai.server import ServerThread

from .conftest import MODEL

pytestmark = pytest.mark.e2e

GREEDY: dict[str, Any] = {"model": MODEL, "extra_body": {"temperature": 0}}
HELLO = [{"role": "user", "content": "Hello"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Forecast for a city", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": TIME}]
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t.get("description"),
                                                "parameters": t["input_schema"]}} for t in TOOLS]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}


def _anthropic(server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _openai(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _prompt_tokens(message: Any) -> int:
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def _raw_events(url: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of a streamed message, read off the wire."""
    r = httpx.post(url + "/v1/messages", json={**body, "stream": True}, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in r.text.split("\n\n")[:-1]:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == name[len("event: "):]
        events.append((payload["type"], payload))
    return events


@pytest.fixture(scope="module")
def claude(server: ServerThread) -> anthropic.Anthropic:
    return _anthropic(server)


def test_create_is_the_chat_answer(claude: anthropic.Anthropic, client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12,
                                          messages=[{"role": "system", "content": "Be brief."}, *HELLO])
    m = claude.messages.create(system="Be brief.", messages=HELLO, max_tokens=12, **GREEDY)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert _prompt_tokens(m) == chat.usage.prompt_tokens and m.usage.output_tokens == 12
    blocks = claude.messages.create(system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
                                    messages=HELLO, max_tokens=12, **GREEDY)
    assert blocks.content[0].text == m.content[0].text


def test_stop_sequences_end_the_turn(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(messages=HELLO, max_tokens=16, **GREEDY).content[0].text
    # three characters first seen after the start, so some text comes before them
    stop = next(whole[p:p + 3] for p in range(1, len(whole) - 3) if whole.index(whole[p:p + 3]) == p)
    m = claude.messages.create(messages=HELLO, max_tokens=16, stop_sequences=["\x00never", stop], **GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == whole[:whole.index(stop)]


def test_a_last_assistant_turn_is_continued(claude: anthropic.Anthropic, client: openai.OpenAI) -> None:
    """Anthropic's prefill: the reply goes on from the assistant's words, as
    chat's continue_final_message (not a new assistant turn after them)."""
    prefill = [*HELLO, {"role": "assistant", "content": "Well,"}]
    m = claude.messages.create(messages=prefill, max_tokens=6, **GREEDY)
    chat = client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=6, temperature=0,
                                          extra_body={"continue_final_message": True,
                                                      "add_generation_prompt": False})
    new_turn = client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=6, temperature=0)
    assert _prompt_tokens(m) == chat.usage.prompt_tokens != new_turn.usage.prompt_tokens
    assert m.content[0].text == chat.choices[0].message.content


def test_streamed_events_tell_the_same_message(claude: anthropic.Anthropic, server: ServerThread) -> None:
    kw: dict[str, Any] = dict(messages=HELLO, max_tokens=10, **GREEDY)
    full = claude.messages.create(**kw)
    events = _raw_events(server.url, {"model": MODEL, "messages": HELLO, "max_tokens": 10, "temperature": 0})
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert "".join(e["delta"]["text"] for n, e in events if n == "content_block_delta") == full.content[0].text
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == full.stop_reason and delta["usage"]["output_tokens"] == 10
    with claude.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == full.content[0].text == final.content[0].text and len(final.content) == 1
    assert final.stop_reason == full.stop_reason and _prompt_tokens(final) == _prompt_tokens(full)
    raw = [e.type for e in claude.messages.create(stream=True, **kw)]
    assert raw[0] == "message_start" and raw[-1] == "message_stop"


def test_output_config_is_structured_output(claude: anthropic.Anthropic) -> None:
    m = claude.messages.create(messages=[{"role": "user", "content": "Weather as JSON"}], max_tokens=200,
                               output_config={"format": {"type": "json_schema", "schema": WEATHER}}, **GREEDY)
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), WEATHER)


# ------------------------------------------------------------------ tools


def test_any_tool_choice_gives_valid_tool_use(tool_server: ServerThread) -> None:
    claude, chat_client = _anthropic(tool_server), _openai(tool_server)
    question = [{"role": "user", "content": "Weather in Oslo for 2 days?"}]
    m = claude.messages.create(messages=question, tools=TOOLS, tool_choice={"type": "any"}, max_tokens=200,
                               **GREEDY)
    chat = chat_client.chat.completions.create(model=MODEL, messages=question, tools=CHAT_TOOLS,
                                               tool_choice="required", max_tokens=200, temperature=0)
    want = [(c.function.name, json.loads(c.function.arguments)) for c in chat.choices[0].message.tool_calls]
    assert want and [(b.name, b.input) for b in m.content] == want and m.stop_reason == "tool_use"
    for block in m.content:
        assert block.type == "tool_use" and block.id
        jsonschema.validate(block.input, SCHEMAS[block.name])
    assert _prompt_tokens(m) == chat.usage.prompt_tokens
    with claude.messages.stream(messages=question, tools=TOOLS, tool_choice={"type": "any"}, max_tokens=200,
                                **GREEDY) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content] == want and final.stop_reason == "tool_use"


def test_named_tool_and_tool_result_round_trip(tool_server: ServerThread) -> None:
    claude, chat_client = _anthropic(tool_server), _openai(tool_server)
    question = [{"role": "user", "content": "What time is it?"}]
    m = claude.messages.create(messages=question, tools=TOOLS, max_tokens=100,
                               tool_choice={"type": "tool", "name": "get_time"}, **GREEDY)
    assert len(m.content) == 1 and m.content[0].name == "get_time"
    use = m.content[0]
    follow = claude.messages.create(messages=[
        *question, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "12:00"}]}],
        tools=TOOLS, tool_choice={"type": "none"}, max_tokens=6, **GREEDY)
    chat = chat_client.chat.completions.create(model=MODEL, messages=[
        *question, {"role": "assistant", "content": "", "tool_calls": [{"id": use.id, "type": "function",
                    "function": {"name": "get_time", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "12:00"}],
        tools=CHAT_TOOLS, tool_choice="none", max_tokens=6, temperature=0)
    assert _prompt_tokens(follow) == chat.usage.prompt_tokens
    assert follow.content[0].text == chat.choices[0].message.content


# -------------------------------------------------------------- thinking


def test_reasoning_is_a_thinking_block(reasoning_server: ServerThread) -> None:
    claude = _anthropic(reasoning_server)
    thought = _openai(reasoning_server).chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=10, temperature=0).choices[0].message.reasoning_content
    m = claude.messages.create(messages=HELLO, max_tokens=10, **GREEDY)
    assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking == thought
    assert m.content[0].signature
    with claude.messages.stream(messages=HELLO, max_tokens=10, **GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == thought
    assert final.content[0].signature


# ----------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"messages": HELLO}, 400, "max_tokens: field required"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 2},
         400, "messages[0].content[0].type: 'image' blocks are not supported"),
        ({"messages": HELLO, "max_tokens": 2, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         400, "tools[0].type"),
        ({"messages": HELLO, "max_tokens": 100000}, 400, "max_tokens: prompt has"),
        ({"messages": HELLO, "max_tokens": 2, "stop_sequences": ["a"] * 5}, 400, "stop_sequences"),
        ({"messages": HELLO, "max_tokens": 2, "model": "claude-x"}, 404, "claude-x"),
    ],
)
def test_errors_have_anthropics_shape(http: httpx.Client, body: dict[str, Any], status: int,
                                      message: str) -> None:
    r = http.post("/v1/messages", json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == (
        "invalid_request_error" if status == 400 else "not_found_error")
    assert error["error"]["message"].startswith(message) or message in error["error"]["message"], error
