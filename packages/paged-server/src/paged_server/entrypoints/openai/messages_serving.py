"""/v1/messages (Anthropic's Messages API) as a chat request in other clothes.

The request becomes a ``ChatCompletionRequest`` and runs the chat path:
``system`` is a system message, ``tool_use`` blocks are an assistant turn's
tool calls, ``tool_result`` blocks are tool messages, ``stop_sequences``
is ``stop``, tool choice ``any`` is ``required`` and ``tool`` a named
function; a last assistant turn is continued (Anthropic's prefill). The choice comes back as content blocks (``thinking`` when a
reasoning parser splits the thought, ``text``, ``tool_use``) with
Anthropic's ``stop_reason`` and usage: ``input_tokens`` counts the prompt
tokens the prefix cache did not serve, ``cache_read_input_tokens`` those it
did. Errors name this API's fields, in Anthropic's error shape. Mapping
after vLLM's ``entrypoints/anthropic/serving.py``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from paged_server.entrypoints.openai.errors import APIError, model_error, rename_param
from paged_server.entrypoints.openai.messages_bodies import content_blocks, stop_reason, usage
from paged_server.entrypoints.openai.messages_protocol import (
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from paged_server.entrypoints.openai.messages_stream import stream_message
from paged_server.entrypoints.openai.protocol import ChatCompletionRequest
from paged_server.entrypoints.openai.serving import OpenAIServing
from paged_server.entrypoints.openai.streaming import EventStreamResponse

# chat's field -> this API's, for errors the chat path raises
_NAMES = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens", "continue_final_message": "messages",
          "response_format": "output_config.format", "reasoning_effort": "output_config.effort"}


class AnthropicMessages:
    """The /v1/messages endpoint over the chat path."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, body: MessagesRequest, request: Request) -> Response:
        names = dict(_NAMES)
        for i in range(len(body.tools or [])):
            names[f"tools[{i}].function.parameters"] = f"tools[{i}].input_schema"
        try:
            chat = ChatCompletionRequest.model_validate(chat_fields(body))
        except ValidationError as exc:
            raise rename_param(model_error(exc), names) from None
        try:
            gen, fmt = await self.serving.start_chat(chat)
        except APIError as exc:
            raise rename_param(exc, names) from None
        message_id = f"msg_{uuid.uuid4().hex}"
        if body.stream:
            return EventStreamResponse(stream_message(gen, fmt, message_id, fmt.model))
        choice = (await self.serving.collect(gen, request))[0]
        parsed = fmt.chat_message("".join(choice.text), choice.finish_reason)
        reason, sequence = stop_reason(parsed["finish_reason"], choice.stop_reason)
        prompt, cached = sum(gen.prompt_tokens), gen.cached_tokens
        return JSONResponse({
            "id": message_id, "type": "message", "role": "assistant", "model": fmt.model,
            "content": content_blocks(parsed["message"]), "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(prompt, cached, choice.num_generated or len(choice.token_ids)),
        })


def chat_fields(body: MessagesRequest) -> dict[str, Any]:
    """The chat request a messages request stands for."""
    messages: list[dict[str, Any]] = []
    if (system := body.system_text()) is not None:
        messages.append({"role": "system", "content": system})
    for message in body.messages:
        messages += chat_messages(message.role, message.content)
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_completion_tokens": body.max_tokens,
        "stop": body.stop_sequences, "temperature": body.temperature, "top_p": body.top_p,
        "top_k": body.top_k, "request_id": uuid.uuid4().hex,
    }
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}} for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
            "type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    config = body.output_config
    if config is not None and config.format is not None:
        fields["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "output", "schema": config.format.schema_}}
    if config is not None and config.effort is not None:
        fields["reasoning_effort"] = config.effort
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and "tool_calls" not in last:
        # Anthropic's prefill: the reply continues the last assistant turn
        fields.update(add_generation_prompt=False, continue_final_message=True)
    if body.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    return {k: v for k, v in fields.items() if v is not None}


def chat_messages(role: str, content: str | list[Any]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become tool
    messages (before the turn's text), tool uses the assistant's calls;
    earlier thinking is left out, as vLLM leaves it out of the prompt."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    tool_messages, text, calls = [], [], []
    for block in content:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolResultBlock):
            tool_messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input)}})
        else:
            assert isinstance(block, ThinkingBlock | RedactedThinkingBlock)
    turn: dict[str, Any] = {"role": role, "content": "".join(text)}
    if calls:
        turn["tool_calls"] = calls
    keep_turn = text or calls or not tool_messages  # a user turn of tool results only is those
    return tool_messages + ([turn] if keep_turn else [])
