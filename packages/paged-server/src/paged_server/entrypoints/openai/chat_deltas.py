"""One chat choice's streamed text, split as the chat path splits it:
reasoning (``--reasoning-parser``), content, and whole tool calls (when the
request offered tools), for the APIs whose streams are not chat chunks
(/v1/responses, /v1/messages)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from paged_server.entrypoints.openai.completion_bodies import ResponseFormat
from paged_server.entrypoints.openai.reasoning import ReasoningStream
from paged_server.entrypoints.openai.tool_calls import ToolCall, ToolStreamParser


@dataclass(slots=True)
class ChatDelta:
    """A piece of reasoning or content text, or one complete tool call."""

    kind: Literal["reasoning", "content", "tool_call"]
    text: str = ""
    call: ToolCall | None = None


class ChatDeltas:
    """Feeds one choice's text deltas through the reasoning and tool-call
    parsers ``fmt`` names, in the order the chat stream does: the thought
    first, then tools parse the content."""

    def __init__(self, fmt: ResponseFormat) -> None:
        self._thinks = ReasoningStream(fmt.reasoning_parser) if fmt.reasoning_parser else None
        self._tools = ToolStreamParser(fmt.tool_call_parser) if fmt.tool_call_parser else None

    @property
    def called(self) -> bool:
        """Whether a tool call was parsed (a ``stop`` finish is then ``tool_calls``)."""
        return bool(self._tools and self._tools.calls)

    def feed(self, text: str, *, final: bool) -> list[ChatDelta]:
        """The deltas ``text`` completes; ``final``: the choice's last text."""
        out: list[ChatDelta] = []
        content = text
        if self._thinks is not None:
            reasoning, content = self._thinks.feed(text, final=final)
            if reasoning:
                out.append(ChatDelta("reasoning", reasoning))
        if self._tools is None:
            if content:
                out.append(ChatDelta("content", content))
            return out
        parser = self._tools
        for delta in parser.feed(content) + (parser.finish() if final else []):
            if delta.get("content"):
                out.append(ChatDelta("content", delta["content"]))
            for call in delta.get("tool_calls", []):
                if "id" in call:  # the first of a call's two deltas
                    out.append(ChatDelta("tool_call", call=parser.calls[call["index"]]))
        return out
