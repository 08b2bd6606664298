"""The request body of /v1/responses (OpenAI's Responses API), pydantic.

Fields are OpenAI's names; ``top_k`` and ``seed`` are accepted as vLLM's
extras. ``input`` items are checked one by one when they become chat
messages (``responses_serving.py``), so an error names ``input[i]``.
Refused with a 400 naming the field, never ignored: ``background: true``
(responses are answered in the request), ``conversation`` and ``prompt``
(no server-side conversations or prompt templates), tools other than
function tools. Accepted and ignored: ``service_tier``, ``prompt_cache_key``,
``safety_identifier``, ``max_tool_calls`` (it bounds built-in tools, of
which there are none), ``truncation: auto`` (a prompt that does not fit is
a 400, as with ``disabled``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from paged_server.entrypoints.openai.protocol import INT64_MAX, INT64_MIN, FiniteFloat, _Strict

# include values this server fills in.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
KNOWN_INCLUDES = (INCLUDE_LOGPROBS, "reasoning.encrypted_content")


class FunctionTool(_Strict):
    """A function the model may call (the only tool type served)."""

    type: Literal["function"] = Field(description="Only function tools are supported.")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """``text.format``: plain text, any JSON object, or a JSON schema."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ValueError("type json_schema needs a name and a schema")
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="Accepted; no effect.")


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="Passed to the chat template as reasoning_effort (as chat's field)."
    )
    summary: str | None = Field(None, description="Accepted; the reasoning text itself is returned.")


class ResponsesRequest(_Strict):
    """POST /v1/responses."""

    model: str | None = Field(None, description="Must name the served model; omitted = the served model.")
    input: str | list[dict[str, Any]] = Field(
        description="Text, or items: messages (input_text / output_text parts), function_call "
        "and function_call_output items; reasoning items are skipped."
    )
    instructions: str | None = Field(None, description="A system message before the input (not "
                                     "carried over by previous_response_id).")
    previous_response_id: str | None = Field(None, description="Continue a stored response's conversation.")
    store: bool = Field(True, description="Keep the response for previous_response_id and GET "
                        "/v1/responses/{id} (an in-memory LRU store).")
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1, description="Default: the rest of the context.")
    temperature: FiniteFloat | None = Field(None, ge=0.0)
    top_p: FiniteFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX, description="vLLM extension.")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX, description="vLLM extension.")
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = Field(None, description="Not supported: only false.")
    priority: int = Field(0, description="vLLM extension: as chat's (--scheduling-policy priority).")
    # Accepted and ignored (see the module docstring).
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if data.get("background"):
                raise ValueError("background: not supported: responses are answered in the request; "
                                 "send false")
            for name, what in (("conversation", "server-side conversations"),
                               ("prompt", "stored prompt templates")):
                if data.get(name) not in (None, "", {}):
                    raise ValueError(f"{name}: not supported: no {what}; send the input itself "
                                     "(or previous_response_id)")
            tools = data.get("tools")
            for i, tool in enumerate(tools if isinstance(tools, list) else []):
                kind = tool.get("type") if isinstance(tool, dict) else None
                if kind != "function":
                    raise ValueError(f"tools[{i}].type: only function tools are supported, got {kind!r}")
        return data

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        for name in self.include or []:
            if name not in KNOWN_INCLUDES:
                raise ValueError(f"include: {name!r} is not supported here; supported: "
                                 f"{', '.join(KNOWN_INCLUDES)}")
        return self

    def wants_logprobs(self) -> bool:
        return INCLUDE_LOGPROBS in (self.include or []) or bool(self.top_logprobs)


# ------------------------------------------------------------ input items
TEXT_PARTS = ("input_text", "output_text")


class TextPart(_Strict):
    """A text part of an input message (``output_text``: an earlier answer sent back)."""

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    """A call an earlier response made, sent back in the input."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="JSON text, as the response gave it.")


class FunctionCallOutputItem(_Strict):
    """What the client's function returned for ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


# item type -> its model; reasoning items are skipped (vLLM drops earlier thoughts too).
INPUT_ITEMS: dict[str, type[_Strict]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}
SKIPPED_ITEMS = ("reasoning",)
