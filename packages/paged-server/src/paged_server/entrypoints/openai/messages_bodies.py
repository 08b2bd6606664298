"""The objects /v1/messages answers with: content blocks, ``stop_reason``,
usage and errors, as Anthropic's ``anthropic`` client types read them.
Pure formatting, shared by the whole body and the stream's events."""

from __future__ import annotations

import json
import uuid
from typing import Any

from paged_server.entrypoints.openai.errors import APIError

# HTTP status -> Anthropic's error type
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}


def anthropic_error_body(err: APIError) -> dict[str, Any]:
    """Anthropic's error envelope, which its clients read."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"),
                                       "message": err.message}}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message (``completion_bodies.chat_message``) as content blocks."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append(thinking_block(message["reasoning_content"]))
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls", []):
        blocks.append(tool_use_block(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return blocks


def thinking_block(text: str) -> dict[str, Any]:
    # Anthropic signs thoughts so they can be sent back unaltered; here the
    # signature is a random token (as vLLM's): nothing reads it.
    return {"type": "thinking", "thinking": text, "signature": uuid.uuid4().hex}


def tool_use_block(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A parsed call; ``input`` must be an object, so arguments the model
    wrote as another JSON value are kept under ``"arguments"``."""
    value = json.loads(arguments)
    return {"type": "tool_use", "id": call_id, "name": name,
            "input": value if isinstance(value, dict) else {"arguments": value}}


def stop_reason(finish_reason: str | None, engine_stop: int | str | None) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` of a chat finish."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(engine_stop, str):
        return "stop_sequence", engine_stop
    return "end_turn", None


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}
