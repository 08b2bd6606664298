"""response_format and tool calls through the real server and the real
``openai`` client, streamed and not; the grammar makes even the random-weight
model's output valid. Tool calls run on a copy of the embedded model whose
chat template renders tools in the hermes (Qwen) style (conftest's tool_server)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from paged_server.entrypoints.openai.server import ServerThread

from .conftest import MODEL

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Give me the weather as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["C", "F"]},
        "hours": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 24},
                  "maxItems": 3},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
# No finite JSON matches: a required property whose type is the object itself.
SELF_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


# ------------------------------------------------------------ response_format


@pytest.mark.parametrize("seed", range(3))
def test_chat_json_schema_validates(client: openai.OpenAI, seed: int) -> None:
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200,
                                          seed=seed, response_format=RESPONSE_FORMAT)
    choice = full.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_chat_json_schema_streamed_equals_non_streamed(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_tokens=200, seed=11, n=2,
                              response_format=RESPONSE_FORMAT)
    full = client.chat.completions.create(**kw)
    texts = ["", ""]
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in full.choices]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


class Weather(BaseModel):
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=7)


def test_client_parse_returns_the_pydantic_model(client: openai.OpenAI) -> None:
    """``client.chat.completions.parse`` sends a strict schema built from a
    pydantic model and parses the reply into it."""
    full = client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=200, seed=2,
                                         response_format=Weather)
    parsed = full.choices[0].message.parsed
    assert isinstance(parsed, Weather) and 1 <= parsed.days <= 7


def test_completions_json_object(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=120, seed=4,
                                    extra_body={"response_format": {"type": "json_schema",
                                                "json_schema": {"name": "w", "schema": SCHEMA}}})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)
    stream = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=120, seed=4, stream=True,
                                       extra_body={"response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "w", "schema": SCHEMA}}})
    assert "".join(c.choices[0].text for c in stream) == out.choices[0].text


def test_json_object_is_an_object_or_cut_by_length(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64, seed=0,
                                         response_format={"type": "json_object"})
    text, reason = out.choices[0].message.content, out.choices[0].finish_reason
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # a random model may write one long key; the prefix is still JSON's
        assert reason == "length" and text.startswith("{")


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "format": "nope"}}}}, "response_format",
         "format"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "not among tools"),
        ({"tool_choice": "required"}, "tool_choice", "at least one tool"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "format": "nope"}}}}}]},
         "tools[0].function.parameters", "format"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "function"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SELF_REQUIRED}}},
         "response_format", "no output can ever complete"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": SELF_REQUIRED}}],
          "tool_choice": "required"}, "tools", "no output can ever complete"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "forced tool_choice"),
    ],
)
def test_bad_values_are_400s_naming_the_field(http: httpx.Client, body: dict[str, Any],
                                              param: str, message: str) -> None:
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert "\n" not in error["message"] and len(error["message"]) < 300  # no parser state dump


# ----------------------------------------------------------------- tool calls


@pytest.fixture(scope="module")
def tool_client(tool_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _check_calls(calls: Any, only: str | None = None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert only is None or call.function.name == only
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_template_renders_tools(tool_server: ServerThread, tool_client: openai.OpenAI) -> None:
    out = tool_client.chat.completions.create(messages=MESSAGES, model=MODEL,
                                              tools=TOOLS, max_tokens=1)
    without = tool_client.chat.completions.create(messages=MESSAGES, model=MODEL, max_tokens=1)
    tok = tool_server.engine.tokenizer
    rendered = tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=True)
    assert out.usage.prompt_tokens == len(rendered) > without.usage.prompt_tokens


@pytest.mark.parametrize("seed", range(3))
def test_required_forces_a_valid_call(tool_client: openai.OpenAI, seed: int) -> None:
    out = tool_client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                              tool_choice="required", max_tokens=200, seed=seed)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls)


def test_named_choice_streamed_equals_non_streamed(tool_client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, seed=5,
                              tool_choice={"type": "function", "function": {"name": "get_time"}})
    full = tool_client.chat.completions.create(**kw)
    calls = full.choices[0].message.tool_calls
    _check_calls(calls, only="get_time")
    assert len(calls) == 1 and full.choices[0].finish_reason == "tool_calls"

    names: dict[int, str] = {}
    args: dict[int, str] = {}
    finish = None
    for chunk in tool_client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                if tc.function.name:
                    assert tc.id and tc.type == "function"
                    names[tc.index] = tc.function.name
                args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
            finish = c.finish_reason or finish
    assert names == {0: "get_time"} and finish == "tool_calls"
    assert json.loads(args[0]) == json.loads(calls[0].function.arguments)


def test_history_with_tool_calls_and_results(tool_server: ServerThread,
                                             tool_client: openai.OpenAI) -> None:
    history: list[Any] = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out = tool_client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                              tool_choice="none", max_tokens=8, seed=1)
    assert out.choices[0].message.tool_calls is None
    prompt = tool_server.engine.tokenizer.apply_chat_template(
        [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]},
         {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}])
    assert '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}' in prompt
    assert "<tool_response>\nsunny" in prompt


def test_auto_gives_content_when_the_model_calls_nothing(tool_client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=12,
                              seed=3, temperature=0)
    full = tool_client.chat.completions.create(**kw)
    assert full.choices[0].message.tool_calls is None
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       tool_client.chat.completions.create(stream=True, **kw) if c.choices)
    assert streamed == full.choices[0].message.content


def test_required_cut_by_max_tokens_keeps_the_complete_calls(tool_client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                              seed=0)
    whole = tool_client.chat.completions.create(max_tokens=400, **kw)
    calls = whole.choices[0].message.tool_calls
    assert len(calls) >= 3  # this seed writes three calls
    # Cut a few tokens before the end: inside the last call, after the others.
    cut = whole.usage.completion_tokens - 4
    full = tool_client.chat.completions.create(max_tokens=cut, **kw)
    kept = full.choices[0].message.tool_calls
    assert full.choices[0].finish_reason == "length"
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in calls[:-1]]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in kept or []] == expected

    names: dict[int, str] = {}
    args: dict[int, str] = {}
    content = ""
    for chunk in tool_client.chat.completions.create(stream=True, max_tokens=cut, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.function.name:
                    names[tc.index] = tc.function.name
                args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
    assert [(names[i], json.loads(args[i])) for i in sorted(names)] == expected
    assert content.strip() == (full.choices[0].message.content or "").strip()
