"""Tool calls in the served families' own formats: grammar, parse, stream.

Two formats, named as vLLM's ``--tool-call-parser`` names them:

- ``hermes`` (Qwen 2.5 / Qwen 3 and the embedded default model): each call
  is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
  text outside the tags is the message content.
- ``llama3_json`` (Llama 3.1 / 3.2): the whole reply is one JSON object
  ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``;
  several calls are separated by ``;``.

``tool_choice`` ``required`` and a named function are enforced with a Lark
grammar (llguidance's ``%json`` embeds each tool's parameter schema), so the
model must emit a well-formed call in its own format; ``auto`` leaves the
model free and parses whatever calls it wrote.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(slots=True)
class ToolCall:
    """One parsed call; ``arguments`` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def detect_parser(chat_template: str | None) -> str:
    """The format a chat template speaks: ``llama3_json`` for Llama 3's
    ``<|python_tag|>`` templates, else ``hermes``."""
    if chat_template and _PYTHON_TAG in chat_template and _HERMES_OPEN not in chat_template:
        return "llama3_json"
    return "hermes"


def call_grammar(parser: str, tools: list[dict[str, Any]], *, parallel: bool) -> str:
    """A Lark grammar (llguidance dialect) admitting only calls to ``tools``
    (``[{"name", "parameters"}]``) in ``parser``'s format."""
    args_key = "parameters" if parser == "llama3_json" else "arguments"
    options = [
        {"type": "object",
         "properties": {"name": {"const": t["name"]}, args_key: t.get("parameters") or _ANY_OBJECT},
         "required": ["name", args_key], "additionalProperties": False}
        for t in tools
    ]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    # Compact JSON, as for response_format: no whitespace for a model to pad with.
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    body = json.dumps(schema, separators=(",", ":"))
    if parser == "llama3_json":
        call = f"%json {body}"
        separator = '"; "'
    else:
        call = f'"<tool_call>\\n" %json {body} "\\n</tool_call>"'
        separator = '"\\n"'
    if parallel:
        return f"start: call ({separator} call)*\ncall: {call}\n"
    return f"start: {call}\n"


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` from a complete reply, exactly what streaming the
    same text through ``ToolStreamParser`` gives: every well-formed call
    (a reply cut by ``max_tokens`` keeps the calls before the cut), the rest
    as content; text that holds no well-formed call is all content."""
    stream = ToolStreamParser(parser)
    deltas = stream.feed(text) + stream.finish()
    if not stream.calls:
        return text, []
    content = "".join(d.get("content", "") for d in deltas).strip()
    return content or None, stream.calls


def _parse_llama(text: str) -> tuple[list[ToolCall], str]:
    """The calls of a llama3_json reply and what follows the last one that
    is not a call (a call cut short); no calls when the first part is not one."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return [], text
    calls: list[ToolCall] = []
    parts = _split_top_level(body)
    for k, part in enumerate(parts):
        call = _call_from_json(part, "parameters")
        if call is None:
            return (calls, "".join(parts[k:])) if calls else ([], text)
        calls.append(call)
    return calls, ""


def _split_top_level(body: str) -> list[str]:
    """JSON objects separated by ``;`` (a ``;`` inside a string stays); text
    from the first one that does not decode on is the last part."""
    decoder, parts, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            _, end = decoder.raw_decode(body, pos)
        except ValueError:
            return [*parts, body[pos:]]  # the caller rejects it as a call
        parts.append(body[pos:end])
        pos = end
        while pos < len(body) and body[pos] in " \n\t;":
            pos += 1
    return parts


def _call_from_json(body: str, args_key: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolStreamParser:
    """Turns one choice's text deltas into chat ``delta`` objects: content
    as it comes, each tool call as two deltas (id + name, then its
    arguments) once the call is complete. Text that may still open a call
    is held back."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.calls: list[ToolCall] = []
        self._pending = ""  # text not yet classified
        self._in_call = False  # hermes: inside <tool_call>
        self._buffer_all: bool | None = None  # llama: the reply is JSON (decided on first text)

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._pending += text
        if self.parser == "llama3_json":
            return self._feed_llama()
        return self._feed_hermes(final=False)

    def finish(self) -> list[dict[str, Any]]:
        """Deltas for whatever is still held when the choice ends."""
        if self.parser == "llama3_json":
            text, self._pending = self._pending, ""
            calls, rest = _parse_llama(text) if self._buffer_all else ([], text)
            return self._emit(calls) + ([{"content": rest}] if rest else [])
        return self._feed_hermes(final=True)

    def _feed_llama(self) -> list[dict[str, Any]]:
        if self._buffer_all is None:
            stripped = self._pending.lstrip()
            if not stripped:
                return []
            self._buffer_all = stripped.startswith("{") or stripped.startswith(_PYTHON_TAG[: len(stripped)])
        if self._buffer_all:
            return []
        text, self._pending = self._pending, ""
        return [{"content": text}]

    def _feed_hermes(self, *, final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while self._pending:
            if self._in_call:
                end = self._pending.find(_HERMES_CLOSE)
                if end < 0 and not final:
                    break
                body = self._pending if end < 0 else self._pending[:end]
                call = _call_from_json(body.strip(), "arguments")
                close = "" if end < 0 else _HERMES_CLOSE
                self._pending = self._pending[len(body) + len(close):]
                self._in_call = False
                if call is None:  # not a call after all: say what was written
                    deltas.append({"content": _HERMES_OPEN + body + close})
                else:
                    deltas += self._emit([call])
                continue
            start = self._pending.find(_HERMES_OPEN)
            if start >= 0:
                content, self._pending = self._pending[:start], self._pending[start + len(_HERMES_OPEN):]
                self._in_call = True
            else:
                keep = 0 if final else _partial_suffix(self._pending, _HERMES_OPEN)
                content = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep:]
            # Whitespace around calls is layout, not content.
            if content and (content.strip() or (start < 0 and not self.calls)):
                deltas.append({"content": content})
            if start < 0:
                break
        return deltas

    def _emit(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        deltas = []
        for call in calls:
            index = len(self.calls)
            self.calls.append(call)
            deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
        return deltas


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
