"""The request body of /v1/messages (Anthropic's Messages API), pydantic.

Anthropic's names and rules: ``max_tokens`` is required, ``system`` is a
string or text blocks, messages alternate ``user`` and ``assistant`` with
text, ``tool_use``, ``tool_result`` and ``thinking`` blocks. Refused with a
400 naming the field: image, document and other non-text blocks
(text-only models) and Anthropic's server tools (web search, code
execution...), which this server does not run. Accepted and ignored:
``metadata``, ``service_tier``, a block's ``cache_control`` (the prefix
cache needs no marks) and ``citations``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from paged_server.entrypoints.openai.protocol import INT64_MAX, FiniteFloat, _Strict

BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Strict):
    """A call an earlier assistant turn made."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Strict):
    """What the client's tool returned for ``tool_use_id``."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(b.text for b in self.content)
        return self.content or ""


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Strict):
    """A client tool: the model may call it; the client runs it."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _check_name(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("type tool needs the tool's name")
        return self


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0, description="Accepted; thinking is not budgeted.")


class OutputFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    """Structured output (enforced by a grammar, as chat's ``response_format``)
    and effort (the chat template's ``reasoning_effort``)."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class MessagesRequest(_Strict):
    """POST /v1/messages."""

    model: str = Field(description="Must name the served model (GET /v1/models).")
    max_tokens: int = Field(ge=1, description="Required, as in Anthropic's API.")
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: FiniteFloat | None = Field(None, ge=0.0)
    top_p: FiniteFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    thinking: ThinkingConfig | None = Field(
        None, description="enabled / disabled set the chat template's enable_thinking."
    )
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        messages = data.get("messages")
        for i, message in enumerate(messages if isinstance(messages, list) else []):
            content = message.get("content") if isinstance(message, dict) else None
            for j, block in enumerate(content if isinstance(content, list) else []):
                kind = block.get("type") if isinstance(block, dict) else None
                if isinstance(kind, str) and kind not in BLOCK_TYPES:
                    raise ValueError(f"messages[{i}].content[{j}].type: {kind!r} blocks are not "
                                     f"supported (text-only models, no server tools); send "
                                     f"{', '.join(BLOCK_TYPES)} blocks")
        tools = data.get("tools")
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise ValueError(f"tools[{i}].type: {kind!r} is a server tool, which this server does "
                                 "not run; send client tools (name, description, input_schema)")
        return data

    def system_text(self) -> str | None:
        if isinstance(self.system, list):
            return "".join(b.text for b in self.system) or None
        return self.system or None
