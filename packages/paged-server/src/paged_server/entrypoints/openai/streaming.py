"""Server-sent events in OpenAI's streaming format.

Each event is ``data: <json>\\n\\n``; a stream ends with ``data: [DONE]``.
A failure mid-stream is sent as ``data: {"error": {...}}`` before [DONE],
which OpenAI's clients raise as an error. `EventStreamResponse` closes the
body generator when the response ends for any reason, so a client that
hangs up mid-stream has its request aborted at once, not whenever the
garbage collector gets to it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from paged_server.entrypoints.openai.completion_bodies import ResponseFormat
from paged_server.entrypoints.openai.errors import error_body
from paged_server.entrypoints.openai.generation import Generation, GenerationEnded
from paged_server.entrypoints.openai.reasoning import ReasoningStream
from paged_server.entrypoints.openai.tool_calls import ToolStreamParser

DONE = b"data: [DONE]\n\n"


# Characters JSON leaves raw (ensure_ascii=False) that str.splitlines breaks a
# line at: clients reading the stream line by line that way (httpx's
# aiter_lines) cut an event in two when generated text holds one.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: dict[str, Any]) -> bytes:
    """One SSE event carrying ``payload`` as compact JSON, on one line by
    any line-splitting rule (see ``_LINE_BREAKS``)."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)
    return b"data: " + text.encode() + b"\n\n"


async def stream_completion(gen: Generation, fmt: ResponseFormat) -> AsyncIterator[bytes]:
    """``text_completion`` chunks: one per output with text; the finish reason
    rides on the choice's last chunk. With ``echo``, a choice's first chunk
    starts with its prompt; with ``continuous_usage_stats``, every chunk
    carries its choice's usage so far (as vLLM)."""
    num_choices = len(gen.engine_ids) * gen.n
    offsets = [0] * num_choices
    started = [False] * num_choices
    generated = 0
    drop = fmt.echo is not None and fmt.echo.drop_generated
    try:
        async for i, out in gen.outputs():
            if out.error:
                yield sse(error_body(f"generation failed: {out.error}", "server_error"))
            first = not started[i]
            new_ids = fmt.return_token_ids and out.new_token_ids
            if not (out.new_text or out.finished or out.new_logprobs or new_ids or (first and fmt.echo)):
                continue
            text, logprobs = fmt.completion_text_and_logprobs(
                i,
                out.new_text,
                out.new_token_ids,
                out.new_logprobs or [],
                out.new_top_logprobs or [],
                out.prompt_logprobs,
                offsets[i],
                first=first,
            )
            offsets[i] += len(text)
            so_far = 0 if drop else out.num_generated_tokens
            if out.finished:
                generated += so_far
            finish = out.finish_reason if out.finished else None
            if not text and not logprobs and not finish and not new_ids:
                continue
            started[i] = True
            yield sse(fmt.completion_chunk(
                i, text, finish, logprobs, stop_reason=out.stop_reason if finish else None,
                usage=fmt.running_usage(gen.prompt_tokens[i // gen.n], so_far),
                token_ids=[] if drop else out.new_token_ids, first=first,
            ))
        if fmt.include_usage:
            yield sse(fmt.usage_chunk(
                "text_completion", sum(gen.prompt_tokens), generated, gen.cached_tokens
            ))
    except GenerationEnded as exc:
        yield sse(error_body(exc.end.message, "server_error", code=exc.end.reason))
    finally:
        gen.abort()
    yield DONE


async def stream_chat(gen: Generation, fmt: ResponseFormat) -> AsyncIterator[bytes]:
    """``chat.completion.chunk``s: a role delta opens each choice, content
    deltas follow, an empty delta with the finish reason (and vLLM's
    ``stop_reason``) closes it; with ``continuous_usage_stats`` every chunk
    carries its choice's usage so far (as vLLM)."""
    generated = 0
    tools = [ToolStreamParser(fmt.tool_call_parser) for _ in range(gen.n)] if fmt.tool_call_parser else None
    thinks = [ReasoningStream(fmt.reasoning_parser) for _ in range(gen.n)] if fmt.reasoning_parser else None
    prompt_tokens = sum(gen.prompt_tokens)
    try:
        for i in range(gen.n):
            yield sse(fmt.chat_first_chunk(i, fmt.running_usage(prompt_tokens, 0)))
            if fmt.chat_echo:  # the echoed last message comes first
                yield sse(fmt.chat_chunk(i, {"content": fmt.chat_echo}, None,
                                         usage=fmt.running_usage(prompt_tokens, 0)))
        async for i, out in gen.outputs():
            if out.error:
                yield sse(error_body(f"generation failed: {out.error}", "server_error"))
            running = fmt.running_usage(prompt_tokens, out.num_generated_tokens)
            ids: list[int] | None = out.new_token_ids  # on the first chunk this output sends
            text, logprobs = out.new_text, None
            if out.new_logprobs:
                logprobs = fmt.chat_logprobs(
                    out.new_token_ids, out.new_logprobs, out.new_top_logprobs or []
                )
            if thinks is not None:  # the thought first; tools parse the content only
                reasoning, text = thinks[i].feed(out.new_text, final=out.finished)
                if reasoning and fmt.include_reasoning:
                    yield sse(fmt.chat_chunk(i, {"reasoning_content": reasoning}, None, logprobs,
                                             usage=running, token_ids=ids))
                    logprobs, ids = None, None
            if (text or logprobs) and tools is None:
                yield sse(fmt.chat_chunk(i, {"content": text}, None, logprobs, usage=running,
                                         token_ids=ids))
                ids = None
            finish = out.finish_reason
            if tools is not None:  # content and calls as the tool parser separates them
                deltas = tools[i].feed(text) + (tools[i].finish() if out.finished else [])
                for delta in deltas:
                    yield sse(fmt.chat_chunk(i, delta, None, usage=running, token_ids=ids))
                    ids = None
                if tools[i].calls and finish == "stop":
                    finish = "tool_calls"
            if out.finished:
                generated += out.num_generated_tokens
                yield sse(fmt.chat_chunk(i, {}, finish, stop_reason=out.stop_reason, usage=running,
                                         token_ids=ids))
            elif ids and fmt.return_token_ids:  # tokens whose text is not out yet
                yield sse(fmt.chat_chunk(i, {}, None, usage=running, token_ids=ids))
        if fmt.include_usage:
            yield sse(fmt.usage_chunk(
                "chat.completion.chunk", prompt_tokens, generated, gen.cached_tokens
            ))
    except GenerationEnded as exc:
        yield sse(error_body(exc.end.message, "server_error", code=exc.end.reason))
    finally:
        gen.abort()
    yield DONE


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response whose generator is always closed."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, headers: dict[str, str] | None = None) -> None:
        super().__init__(
            content,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
