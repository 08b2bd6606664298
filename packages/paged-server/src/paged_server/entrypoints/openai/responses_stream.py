"""A streamed /v1/responses: OpenAI's named server-sent events.

``response.created`` and ``response.in_progress`` open the stream; each
output item is ``response.output_item.added``, its part and text deltas
(``response.reasoning_text.delta``, ``response.output_text.delta``, or one
``response.function_call_arguments.delta`` per call, sent whole once the
call has parsed), their ``.done`` events, ``response.output_item.done``;
``response.completed`` (``response.incomplete`` when cut by
``max_output_tokens``, ``response.failed`` on an engine failure) carries
the whole response. Every event has a ``sequence_number``; there is no
``[DONE]``, as OpenAI's own stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from paged_server.entrypoints.openai.chat_deltas import ChatDelta, ChatDeltas
from paged_server.entrypoints.openai.completion_bodies import ResponseFormat
from paged_server.entrypoints.openai.generation import Generation, GenerationEnded
from paged_server.entrypoints.openai.responses_bodies import (
    ResponseObject,
    function_call_item,
    message_item,
    new_id,
    output_text,
    reasoning_item,
    reasoning_tokens,
    usage,
)
from paged_server.entrypoints.openai.streaming import sse


@dataclass(slots=True)
class _Open:
    """The output item being streamed: a reasoning or a message item."""

    kind: str  # "reasoning" | "message"
    id: str
    index: int
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)


class _Events:
    """Numbers and encodes one stream's events, and keeps its output items."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: _Open | None = None
        self.reasoning = ""

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\n" + sse(payload)

    def add(self, delta: ChatDelta, logprobs: list[dict[str, Any]]) -> list[bytes]:
        """Events for one delta: the open item closed if the kind changes."""
        kind = {"reasoning": "reasoning", "content": "message"}.get(delta.kind)
        out: list[bytes] = []
        if self.open is not None and self.open.kind != kind:
            out += self.close("completed")
        if delta.kind == "tool_call":
            assert delta.call is not None
            item_id, index = new_id("fc"), len(self.output)
            ref = {"item_id": item_id, "output_index": index}
            item = function_call_item(item_id, delta.call, "completed")
            out.append(self.event("response.output_item.added", output_index=index,
                                  item=function_call_item(item_id, delta.call, "in_progress", arguments="")))
            out.append(self.event("response.function_call_arguments.delta", **ref, delta=item["arguments"]))
            out.append(self.event("response.function_call_arguments.done", **ref, arguments=item["arguments"]))
            out.append(self.event("response.output_item.done", output_index=index, item=item))
            self.output.append(item)
            return out
        if self.open is None:
            out += self._start(kind)
        assert self.open is not None
        item = self.open
        item.text += delta.text
        ref = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if kind == "reasoning":
            self.reasoning += delta.text
            out.append(self.event("response.reasoning_text.delta", **ref, delta=delta.text))
        else:
            item.logprobs += logprobs
            out.append(self.event("response.output_text.delta", **ref, delta=delta.text, logprobs=logprobs))
        return out

    def _start(self, kind: str | None) -> list[bytes]:
        assert kind is not None
        item_id, index = new_id("rs" if kind == "reasoning" else "msg"), len(self.output)
        self.open = _Open(kind, item_id, index)
        if kind == "reasoning":
            item, part = reasoning_item(item_id, "", "in_progress"), {"type": "reasoning_text", "text": ""}
        else:
            item, part = message_item(item_id, "in_progress", []), output_text("")
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.content_part.added", item_id=item_id, output_index=index,
                           content_index=0, part=part)]

    def close(self, status: str) -> list[bytes]:
        """The ``.done`` events of the open item, which joins the output."""
        item, self.open = self.open, None
        if item is None:
            return []
        ref = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if item.kind == "reasoning":
            part = {"type": "reasoning_text", "text": item.text}
            done = reasoning_item(item.id, item.text, status)
            text_done = self.event("response.reasoning_text.done", **ref, text=item.text)
        else:
            part = output_text(item.text, item.logprobs)
            done = message_item(item.id, status, [part])
            text_done = self.event("response.output_text.done", **ref, text=item.text, logprobs=item.logprobs)
        self.output.append(done)
        return [text_done, self.event("response.content_part.done", **ref, part=part),
                self.event("response.output_item.done", output_index=item.index, item=done)]


async def stream_response(
    gen: Generation,
    fmt: ResponseFormat,
    response: ResponseObject,
    tokenizer: Any,
    done: Callable[[dict[str, Any]], None],
) -> AsyncIterator[bytes]:
    """The events of one response; ``done`` gets the final response object
    (to store it) unless the client went away first."""
    events = _Events()
    deltas = ChatDeltas(fmt)
    yield events.event("response.created", response=response.body("in_progress", []))
    yield events.event("response.in_progress", response=response.body("in_progress", []))
    finish, generated, error = None, 0, None
    try:
        async for _, out in gen.outputs():
            if out.error:
                error = f"generation failed: {out.error}"
                break
            logprobs: list[dict[str, Any]] = []
            if fmt.num_top is not None and out.new_logprobs:
                logprobs = fmt.chat_logprobs(out.new_token_ids, out.new_logprobs,
                                             out.new_top_logprobs or [])["content"]
            for delta in deltas.feed(out.new_text, final=out.finished):
                for chunk in events.add(delta, logprobs):
                    yield chunk
                if delta.kind == "content":
                    logprobs = []  # on the output's first content delta only
            if out.finished:
                finish, generated = out.finish_reason, out.num_generated_tokens
    except GenerationEnded as exc:
        error = exc.end.message
    finally:
        gen.abort()
    status = "failed" if error else "incomplete" if finish == "length" else "completed"
    for chunk in events.close("incomplete" if status == "incomplete" else "completed"):
        yield chunk
    counts = usage(sum(gen.prompt_tokens), generated, gen.cached_tokens,
                   reasoning_tokens(tokenizer, events.reasoning))
    if error:
        final = response.body("failed", events.output, counts, error={"code": "server_error", "message": error})
        yield events.event("response.failed", response=final)
        return
    final = response.body(status, events.output, counts)
    done(final)
    yield events.event(f"response.{status}", response=final)
