"""/v1/responses (OpenAI's Responses API) as a chat request in other clothes.

The request becomes a ``ChatCompletionRequest`` and runs the chat path
(template, sampling, tools, structured output, reasoning split), then its
choice is told as a response: ``instructions`` is a system message before
the input; ``input`` items map to chat messages (``function_call`` to an
assistant turn's tool calls, ``function_call_output`` to a tool message);
``previous_response_id`` puts a stored response's conversation before the
input; ``text.format`` is ``response_format``, ``max_output_tokens`` is
``max_tokens``, ``reasoning.effort`` is ``reasoning_effort``. Errors name
this API's fields. Field mapping after vLLM's ``serving_responses.py``.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from paged_server.entrypoints.openai.completion_bodies import CollectedChoice, ResponseFormat
from paged_server.entrypoints.openai.errors import APIError, model_error, rename_param
from paged_server.entrypoints.openai.generation import Generation
from paged_server.entrypoints.openai.protocol import ChatCompletionRequest
from paged_server.entrypoints.openai.response_store import ResponseStore
from paged_server.entrypoints.openai.responses_bodies import (
    ResponseObject,
    function_call_item,
    message_item,
    new_id,
    output_messages,
    output_text,
    reasoning_item,
    reasoning_tokens,
    usage,
)
from paged_server.entrypoints.openai.responses_protocol import (
    INPUT_ITEMS,
    SKIPPED_ITEMS,
    TEXT_PARTS,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequest,
)
from paged_server.entrypoints.openai.responses_stream import stream_response
from paged_server.entrypoints.openai.serving import OpenAIServing
from paged_server.entrypoints.openai.streaming import EventStreamResponse
from paged_server.entrypoints.openai.tool_calls import ToolCall

# chat's field -> this API's, for errors the chat path raises
_NAMES = {"messages": "input", "max_tokens": "max_output_tokens",
          "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
          "reasoning_effort": "reasoning.effort"}


class OpenAIResponses:
    """The /v1/responses endpoints over the chat path, with their store."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore | None = None) -> None:
        self.serving = serving
        self.store = store if store is not None else ResponseStore()

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        """Answer (or stream) one response; store it when ``store`` is true."""
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id)
            if previous is None:
                raise APIError(404, f"previous_response_id: no stored response '{body.previous_response_id}' "
                               "(unknown, evicted from the in-memory store, created with store: false, "
                               "or before a restart); send the conversation as input instead",
                               param="previous_response_id", code="not_found")
            history = previous.messages
        conversation = history + input_messages(body.input)
        gen, fmt = await self._start(body, conversation)
        response = ResponseObject(body, new_id("resp"), fmt.model)

        def done(final: dict[str, Any]) -> None:
            if body.store and final["status"] != "failed":
                self.store.put(response.id, final, conversation + output_messages(final["output"]))

        if body.stream:
            return EventStreamResponse(stream_response(gen, fmt, response, self.serving.tokenizer, done))
        choice = (await self.serving.collect(gen, request))[0]
        final = whole_response(choice, fmt, response, gen, self.serving.tokenizer)
        done(final)
        return JSONResponse(final)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        """A stored response (GET /v1/responses/{id})."""
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_stored(response_id)
        return entry.body

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise _not_stored(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def _start(self, body: ResponsesRequest, conversation: list[dict[str, Any]]) -> tuple[Generation, ResponseFormat]:
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        names = dict(_NAMES)
        for i in range(len(body.tools or [])):
            names[f"tools[{i}].function.parameters"] = f"tools[{i}].parameters"
        try:
            chat = ChatCompletionRequest.model_validate(chat_fields(body, system + conversation))
        except ValidationError as exc:
            raise rename_param(model_error(exc), names) from None
        try:
            return await self.serving.start_chat(chat)
        except APIError as exc:
            raise rename_param(exc, names) from None


def chat_fields(body: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request a response request stands for."""
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
        "user": body.user, "request_id": uuid.uuid4().hex, "priority": body.priority,
    }
    if body.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                           for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = choice if isinstance(choice, str) else {
            "type": "function", "function": {"name": choice.name}}
    if body.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_ or {}, "description": fmt.description, "strict": fmt.strict}}
    elif fmt is not None:
        fields["response_format"] = {"type": fmt.type}
    if body.reasoning and body.reasoning.effort:
        fields["reasoning_effort"] = body.reasoning.effort
    if body.wants_logprobs():
        fields["logprobs"] = True
        fields["top_logprobs"] = body.top_logprobs or 0
    return {k: v for k, v in fields.items() if v is not None}


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages: each item checked (a 400 names
    ``input[i]``), consecutive function calls joined to one assistant turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, raw in enumerate(items):
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        if kind in SKIPPED_ITEMS:
            continue
        model = INPUT_ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise APIError(400, f"input[{i}].type: {kind!r} items are not supported here; send "
                           f"{', '.join(INPUT_ITEMS)} (or reasoning) items", param=f"input[{i}].type")
        _check_parts(raw, i)
        try:
            item = model.model_validate(raw)
        except ValidationError as exc:
            raise model_error(exc, "input", i) from None
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def _check_parts(raw: dict[str, Any], i: int) -> None:
    """Text-only models: an image or file part is a 400 naming it."""
    parts = raw.get("content", raw.get("output"))
    for j, part in enumerate(parts if isinstance(parts, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            where = "content" if "content" in raw else "output"
            raise APIError(400, f"input[{i}].{where}[{j}].type: only text parts (input_text, output_text) "
                           f"are supported (text-only models), got {kind!r}",
                           param=f"input[{i}].{where}[{j}].type")


def whole_response(choice: CollectedChoice, fmt: ResponseFormat, response: ResponseObject,
                   gen: Generation, tokenizer: Any) -> dict[str, Any]:
    """The response object of a finished choice."""
    parsed = fmt.chat_message("".join(choice.text), choice.finish_reason)
    message = parsed["message"]
    incomplete = parsed["finish_reason"] == "length"
    status = "incomplete" if incomplete else "completed"
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if reasoning:
        output.append(reasoning_item(new_id("rs"), reasoning, status))
    if message["content"]:
        logprobs = (fmt.chat_logprobs(choice.token_ids, choice.logprobs, choice.top_logprobs)["content"]
                    if fmt.num_top is not None else None)
        output.append(message_item(new_id("msg"), status, [output_text(message["content"], logprobs)]))
    for call in message.get("tool_calls", []):
        tool_call = ToolCall(call["function"]["name"], call["function"]["arguments"], call["id"])
        output.append(function_call_item(new_id("fc"), tool_call, "completed"))
    generated = choice.num_generated or len(choice.token_ids)
    return response.body(status, output, usage(sum(gen.prompt_tokens), generated, gen.cached_tokens,
                                                reasoning_tokens(tokenizer, reasoning)))


def _not_stored(response_id: str) -> APIError:
    return APIError(404, f"response_id: no stored response '{response_id}' (unknown, evicted, or "
                    "created with store: false)", param="response_id", code="not_found")
