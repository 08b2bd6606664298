"""/v1/responses through the real server and OpenAI's own client, unchanged:
``responses.create`` (streamed and not), ``responses.stream``,
``responses.parse``, ``retrieve`` and ``delete``. Chat completions are the
oracle: a response must be exactly what the chat request it stands for
gives (greedy, so the random-weight model is deterministic); the grammar
makes even that model's tool calls and JSON valid."""

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

GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Forecast for a city", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": TIME}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
PARAMS = {t["name"]: t["parameters"] for t in TOOLS}


def _client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _events(stream: Any) -> list[Any]:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    return events


def _check_item_order(events: list[Any]) -> None:
    """Each item: added, (part added), deltas, (text done, part done), done."""
    open_items: dict[int, str] = {}
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert e.output_index not in open_items
            open_items[e.output_index] = e.item.id
        elif e.type == "response.output_item.done":
            assert open_items.pop(e.output_index) == e.item.id and e.item.status in ("completed", "incomplete")
        else:
            assert open_items.get(e.output_index) == e.item_id, e.type
    assert not open_items


# ------------------------------------------------------------------ text


def test_create_is_the_chat_answer(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(messages=[{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Hello"}], max_tokens=12, **GREEDY)
    r = client.responses.create(instructions="Be brief.", input="Hello", max_output_tokens=12, **GREEDY)
    choice = chat.choices[0]
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.output_text == choice.message.content
    assert [o.type for o in r.output] == ["message"] and r.output[0].id.startswith("msg_")
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if choice.finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    assert r.instructions == "Be brief." and r.max_output_tokens == 12 and r.temperature == 0


def test_input_items_are_the_chat_messages(client: openai.OpenAI) -> None:
    messages = [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Weather?"}]
    chat = client.chat.completions.create(messages=messages, max_tokens=8, **GREEDY)
    items: list[Any] = [
        messages[0], {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # skipped
        messages[3],
    ]
    r = client.responses.create(input=items, max_output_tokens=8, **GREEDY)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_events_tell_the_same_response(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(input="Tell me a story", max_output_tokens=10, **GREEDY)
    full = client.responses.create(**kw)
    events = _events(client.responses.create(stream=True, **kw))
    _check_item_order(events)
    types = [e.type for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{full.status}"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == full.output_text and final.id == events[0].response.id
    assert final.usage.input_tokens == full.usage.input_tokens
    assert final.usage.output_tokens == full.usage.output_tokens


class Weather(BaseModel):
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=7)


def test_text_format_is_structured_output(client: openai.OpenAI) -> None:
    """``responses.parse`` sends a strict json_schema built from a pydantic
    model; ``responses.stream`` with it reads the same parsed object."""
    kw: dict[str, Any] = dict(input="The weather as JSON", max_output_tokens=200, **GREEDY)
    parsed = client.responses.parse(text_format=Weather, **kw)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Weather)
    with client.responses.stream(text_format=Weather, **kw) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed
    obj = client.responses.create(text={"format": {"type": "json_object"}}, **kw)
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)
    else:  # a random model may write one long key; the prefix is still JSON's
        assert obj.output_text.startswith("{")


def test_logprobs_are_chats(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          logprobs=True, top_logprobs=2, **GREEDY)
    r = client.responses.create(input="Hi", max_output_tokens=4, top_logprobs=2,
                                include=["message.output_text.logprobs"], **GREEDY)
    got = [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in r.output[0].content[0].logprobs]
    want = [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in chat.choices[0].logprobs.content]
    assert got == want and len(got) == 4


# -------------------------------------------------------------- the store


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(instructions="Be brief.", input="Hello", max_output_tokens=6, **GREEDY)
    second = client.responses.create(instructions="Answer in French.", input="And then?",
                                     previous_response_id=first.id, max_output_tokens=6, **GREEDY)
    # the first turn's instructions are not carried over, its output is
    chat = client.chat.completions.create(messages=[
        {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And then?"}],
        max_tokens=6, **GREEDY)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id
    # a streamed response is stored too, and chains on
    events = _events(client.responses.create(input="More", previous_response_id=second.id, stream=True,
                                             max_output_tokens=4, **GREEDY))
    third = client.responses.retrieve(events[-1].response.id)
    assert third.output_text == events[-1].response.output_text and third.previous_response_id == second.id


def test_retrieve_delete_and_store_false(client: openai.OpenAI) -> None:
    kept = client.responses.create(input="Hello", max_output_tokens=3, **GREEDY)
    again = client.responses.retrieve(kept.id)
    assert again.id == kept.id and again.output_text == kept.output_text and again.usage == kept.usage
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    unstored = client.responses.create(input="Hello", max_output_tokens=3, store=False, **GREEDY)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(input="x", previous_response_id=unstored.id, max_output_tokens=2)
    assert exc.value.body["param"] == "previous_response_id" and "store: false" in exc.value.body["message"]


# ------------------------------------------------------------------ tools


def _calls(r: Any) -> list[tuple[str, Any]]:
    return [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]


def test_required_tool_calls_are_chats_and_valid(tool_server: ServerThread) -> None:
    client = _client(tool_server)
    question = [{"role": "user", "content": "Weather in Oslo for 2 days?"}]
    r = client.responses.create(input=question, tools=TOOLS, tool_choice="required", max_output_tokens=200,
                                **GREEDY)
    chat = client.chat.completions.create(messages=question, tools=CHAT_TOOLS, tool_choice="required",
                                          max_tokens=200, **GREEDY)
    want = [(c.function.name, json.loads(c.function.arguments)) for c in chat.choices[0].message.tool_calls]
    assert want and _calls(r) == want and r.status == "completed"
    for item in r.output:
        assert item.type == "function_call" and item.call_id.startswith("call_") and item.id.startswith("fc_")
        jsonschema.validate(json.loads(item.arguments), PARAMS[item.name])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    events = _events(client.responses.create(input=question, tools=TOOLS, tool_choice="required",
                                             max_output_tokens=200, stream=True, **GREEDY))
    _check_item_order(events)
    assert _calls(events[-1].response) == want
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(a) for a in done] == [args for _, args in want]


def test_named_tool_choice_calls_that_tool(tool_server: ServerThread) -> None:
    r = _client(tool_server).responses.create(input="What time is it?", tools=TOOLS, max_output_tokens=100,
                                              tool_choice={"type": "function", "name": "get_time"}, **GREEDY)
    calls = _calls(r)
    assert len(calls) == 1 and calls[0][0] == "get_time"
    jsonschema.validate(calls[0][1], TIME)


def test_function_call_output_round_trip(tool_server: ServerThread) -> None:
    """The call sent back with its output (stateless, or after
    previous_response_id) renders as chat's assistant tool call + tool message."""
    client = _client(tool_server)
    question = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.responses.create(input=question, tools=TOOLS, max_output_tokens=200, **GREEDY,
                                    tool_choice={"type": "function", "name": "get_weather"})
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    stateless = client.responses.create(input=[*question, *[o.model_dump() for o in first.output], result],
                                        tools=TOOLS, tool_choice="none", max_output_tokens=6, **GREEDY)
    chained = client.responses.create(input=[result], previous_response_id=first.id, tools=TOOLS,
                                      tool_choice="none", max_output_tokens=6, **GREEDY)
    chat = client.chat.completions.create(messages=[*question, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}],
        tools=CHAT_TOOLS, tool_choice="none", max_tokens=6, **GREEDY)
    assert stateless.usage.input_tokens == chained.usage.input_tokens == chat.usage.prompt_tokens
    assert stateless.output_text == chained.output_text == chat.choices[0].message.content


# -------------------------------------------------------------- reasoning


def test_reasoning_is_a_reasoning_item(reasoning_server: ServerThread) -> None:
    client = _client(reasoning_server)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Think"}], max_tokens=10, **GREEDY)
    thought = chat.choices[0].message.reasoning_content
    r = client.responses.create(input="Think", max_output_tokens=10, **GREEDY)
    assert [o.type for o in r.output] == ["reasoning"] and r.output[0].id.startswith("rs_")
    assert r.output[0].content[0].text == thought and r.output_text == ""
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    events = _events(client.responses.create(input="Think", max_output_tokens=10, stream=True, **GREEDY))
    _check_item_order(events)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert events[-1].response.output[0].content[0].text == thought


# ----------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type", "not supported"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type", "text-only"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", "required"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
        ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens", "max_model_len"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "w",
                                            "schema": {"type": "string", "format": "nope"}}}},
         "text.format", "format"),
        ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "format": "nope"}}}}]},
         "tools[0].parameters", "format"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "at least one tool"),
        ({"input": "x", "background": True}, "background", "not supported"),
        ({"input": []}, "input", ""),
    ],
)
def test_bad_values_are_400s_naming_the_field(http: httpx.Client, body: dict[str, Any], param: str,
                                              message: str) -> None:
    r = http.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert error["message"].startswith(param) and "\n" not in error["message"]
