"""Tool-call formats: parsing complete replies, and streaming the same reply
in arbitrary pieces into OpenAI deltas that add up to the same calls."""

from __future__ import annotations

import json
from typing import Any

import pytest

from paged_server.entrypoints.openai.tool_calls import (
    ToolStreamParser,
    detect_parser,
    parse_tool_calls,
)

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "a;b"}}; {"name": "get_time", "parameters": {}}'


def _calls(calls: Any) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_reply_splits_into_content_and_calls() -> None:
    content, calls = parse_tool_calls("hermes", HERMES)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "UTC"})]
    assert calls[0].id != calls[1].id


def test_llama_reply_with_python_tag_and_two_calls() -> None:
    content, calls = parse_tool_calls("llama3_json", LLAMA)
    assert content is None
    assert _calls(calls) == [("get_weather", {"city": "a;b"}), ("get_time", {})]


@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", "no calls here"),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>"),
    ("llama3_json", "Sure, {not a call}"),
    ("llama3_json", '{"no_name": 1}'),
])
def test_text_without_a_well_formed_call_is_content(parser: str, text: str) -> None:
    assert parse_tool_calls(parser, text) == (text, [])


def _stream(parser: str, text: str, piece: int) -> tuple[str, list[tuple[str, Any]]]:
    stream = ToolStreamParser(parser)
    deltas = []
    for i in range(0, len(text), piece):
        deltas += stream.feed(text[i : i + piece])
    deltas += stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                names[tc["index"]] = tc["function"]["name"]
            args[tc["index"]] = args.get(tc["index"], "") + tc["function"]["arguments"]
    return content, [(names[i], json.loads(args[i])) for i in sorted(names)]


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
@pytest.mark.parametrize(("parser", "text"), [("hermes", HERMES), ("llama3_json", LLAMA),
                                              ("hermes", "plain <tool text> stays"),
                                              ("llama3_json", "plain text")])
def test_streamed_deltas_add_up_to_the_parsed_reply(parser: str, text: str, piece: int) -> None:
    content, calls = parse_tool_calls(parser, text)
    streamed_content, streamed_calls = _stream(parser, text, piece)
    assert streamed_calls == _calls(calls)
    assert streamed_content.strip() == (content or "").strip()


@pytest.mark.parametrize("piece", [1, 4, 1000])
@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", "<tool_call>\n{not json}\n</tool_call>"),
    ("llama3_json", '{"no_name": 1}'),
])
def test_a_malformed_call_streams_back_as_the_same_text(parser: str, text: str, piece: int) -> None:
    assert _stream(parser, text, piece) == (text, [])


# Cut by max_tokens inside the third call: the two complete calls are kept.
CUT = {"hermes": HERMES + '\n<tool_call>\n{"name": "get_we',
       "llama3_json": LLAMA + '; {"name": "get_we'}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_a_reply_cut_inside_a_call_keeps_the_complete_calls(parser: str) -> None:
    content, calls = parse_tool_calls(parser, CUT[parser])
    assert [name for name, _ in _calls(calls)] == ["get_weather", "get_time"]
    assert content is not None and content.endswith('{"name": "get_we')
    for piece in (1, 5, 1000):
        streamed_content, streamed_calls = _stream(parser, CUT[parser], piece)
        assert streamed_calls == _calls(calls)
        assert streamed_content.strip() == content.strip()


def test_parser_detected_from_the_template() -> None:
    assert detect_parser("{{ '<|python_tag|>' }}{{ tools }}") == "llama3_json"
    assert detect_parser("<tool_call>{{ tools }}</tool_call>") == "hermes"
    assert detect_parser(None) == "hermes"
