"""The objects /v1/responses answers with: the response, its output items
(reasoning, message, function_call) and usage, as OpenAI's ``openai``
client types read them. Pure formatting, shared by the whole body and the
stream's events."""

from __future__ import annotations

import time
import uuid
from typing import Any

from paged_server.entrypoints.openai.responses_protocol import ResponsesRequest
from paged_server.entrypoints.openai.tool_calls import ToolCall


def new_id(prefix: str) -> str:
    """``resp_...``, ``msg_...``, ``rs_...``, ``fc_...``: OpenAI's id prefixes."""
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(item_id: str, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def function_call_item(item_id: str, call: ToolCall, status: str, arguments: str | None = None) -> dict[str, Any]:
    """A call as an output item; ``call_id`` is what ``function_call_output`` answers."""
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments, "status": status}


def usage(input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def reasoning_tokens(tokenizer: Any, reasoning: str | None) -> int:
    """The reasoning's length in tokens, as the tokenizer counts its text
    (``output_tokens_details.reasoning_tokens``)."""
    return len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0


class ResponseObject:
    """One request's response object: its id and the request's settings
    echoed, around whatever output and status it has so far."""

    def __init__(self, body: ResponsesRequest, response_id: str, model: str) -> None:
        self.id = response_id
        self.created_at = int(time.time())
        fmt = body.text.format if body.text and body.text.format else None
        choice = body.tool_choice or ("auto" if body.tools else "none")
        self._echo: dict[str, Any] = {
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": model,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "top_logprobs": body.top_logprobs,
            "top_p": body.top_p,
            "truncation": body.truncation or "disabled",
            "metadata": body.metadata or {},
            "user": body.user,
        }

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        *,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The response object; ``incomplete``: cut by ``max_output_tokens``."""
        done = status in ("completed", "incomplete", "failed")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "output": output,
            "usage": usage if done else None,
            **self._echo,
        }


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages that continue its
    conversation: one assistant turn with its text and calls, empty when it
    had neither (reasoning is left out, as vLLM leaves earlier thoughts out)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]
