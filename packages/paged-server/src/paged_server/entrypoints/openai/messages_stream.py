"""A streamed /v1/messages: Anthropic's named server-sent events.

``message_start`` (with the input usage) and a ``ping`` open the stream;
each content block is ``content_block_start``, its deltas (``text_delta``,
``thinking_delta`` then a ``signature_delta``, or one ``input_json_delta``
per tool call, sent whole once the call has parsed) and
``content_block_stop``; ``message_delta`` carries ``stop_reason`` and the
usage, ``message_stop`` ends it. A failure is an ``error`` event, which
Anthropic's clients raise.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from paged_server.entrypoints.openai.chat_deltas import ChatDelta, ChatDeltas
from paged_server.entrypoints.openai.completion_bodies import ResponseFormat
from paged_server.entrypoints.openai.generation import Generation, GenerationEnded
from paged_server.entrypoints.openai.messages_bodies import stop_reason, tool_use_block, usage
from paged_server.entrypoints.openai.streaming import sse


def event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\n" + sse({"type": kind, **fields})


class _Blocks:
    """The content blocks of one message, as events; one open at a time."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None  # "text" | "thinking"

    def add(self, delta: ChatDelta) -> list[bytes]:
        kind = {"reasoning": "thinking", "content": "text"}.get(delta.kind)
        out = self.close() if self.open is not None and self.open != kind else []
        if delta.kind == "tool_call":
            assert delta.call is not None
            block = tool_use_block(delta.call.id, delta.call.name, delta.call.arguments)
            out.append(self._start({**block, "input": {}}))
            out.append(event("content_block_delta", index=self.count - 1,
                             delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])}))
            out.append(event("content_block_stop", index=self.count - 1))
            return out
        if self.open is None:
            self.open = kind
            out.append(self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                   else {"type": "text", "text": ""}))
        body = ({"type": "thinking_delta", "thinking": delta.text} if kind == "thinking"
                else {"type": "text_delta", "text": delta.text})
        out.append(event("content_block_delta", index=self.count - 1, delta=body))
        return out

    def _start(self, block: dict[str, Any]) -> bytes:
        self.count += 1
        return event("content_block_start", index=self.count - 1, content_block=block)

    def close(self) -> list[bytes]:
        """The open block's end (a thought's signature first)."""
        kind, self.open = self.open, None
        if kind is None:
            return []
        out = []
        if kind == "thinking":  # a random token, as the whole body's (nothing reads it)
            out.append(event("content_block_delta", index=self.count - 1,
                             delta={"type": "signature_delta", "signature": uuid.uuid4().hex}))
        return [*out, event("content_block_stop", index=self.count - 1)]


async def stream_message(gen: Generation, fmt: ResponseFormat, message_id: str, model: str) -> AsyncIterator[bytes]:
    """The events of one message."""
    blocks, deltas = _Blocks(), ChatDeltas(fmt)
    started, error = False, None
    finish, engine_stop, generated = None, None, 0
    prompt = sum(gen.prompt_tokens)
    try:
        async for _, out in gen.outputs():
            if not started:  # the first output knows the prefix-cache hits the usage reports
                started = True
                message = {"id": message_id, "type": "message", "role": "assistant", "model": model,
                           "content": [], "stop_reason": None, "stop_sequence": None,
                           "usage": usage(prompt, gen.cached_tokens, 0)}
                yield event("message_start", message=message)
                yield event("ping")
            if out.error:
                error = f"generation failed: {out.error}"
                break
            for delta in deltas.feed(out.new_text, final=out.finished):
                for chunk in blocks.add(delta):
                    yield chunk
            if out.finished:
                finish, engine_stop, generated = out.finish_reason, out.stop_reason, out.num_generated_tokens
    except GenerationEnded as exc:
        error = exc.end.message
    finally:
        gen.abort()
    if error:
        yield event("error", error={"type": "api_error", "message": error})
        return
    for chunk in blocks.close():
        yield chunk
    reason, sequence = stop_reason("tool_calls" if finish == "stop" and deltas.called else finish, engine_stop)
    yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                usage=usage(prompt, gen.cached_tokens, generated))
    yield event("message_stop")
