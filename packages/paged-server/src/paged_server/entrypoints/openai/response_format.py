"""From a request's ``response_format`` and ``tool_choice`` to the engine's
``StructuredOutputsParams``, checked here so a bad schema is a 400 naming
the field (``response_format``, ``tools[i].function.parameters``) rather
than an error from the engine."""

from __future__ import annotations

from typing import Any

from paged_server.engine.sample.grammar_mask import grammar_source
from paged_server.entrypoints.openai.errors import APIError
from paged_server.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    NamedToolChoice,
    ResponseFormatParam,
)
from paged_server.entrypoints.openai.tool_calls import call_grammar
from paged_server.output_constraint import StructuredOutputsParams


def response_format_constraint(fmt: ResponseFormatParam | None) -> StructuredOutputsParams | None:
    """``json_object`` / ``json_schema`` as a constraint; ``text`` or none: ``None``."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    assert fmt.json_schema is not None  # the protocol checked it
    return _checked(StructuredOutputsParams(json=fmt.json_schema.schema_), "response_format")


def request_constraint(body: Any) -> tuple[StructuredOutputsParams | None, str]:
    """vLLM's ``guided_*`` fields or ``structured_outputs`` object as a
    constraint, and the field that set it (the protocol allows one)."""
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            return _checked(StructuredOutputsParams(**{key: value}), name), name
    so = body.structured_outputs
    if so is None:
        return None, "structured_outputs"
    spec = StructuredOutputsParams(
        json=so.json_, json_object=bool(so.json_object), grammar=so.grammar, regex=so.regex,
        choice=so.choice,
    )
    return _checked(spec, "structured_outputs"), "structured_outputs"


def tool_constraint(body: ChatCompletionRequest, parser: str) -> StructuredOutputsParams | None:
    """A grammar forcing a call for ``required`` or a named function; every
    tool's parameter schema is checked whatever the choice."""
    tools = body.tools or []
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None:
            _checked(StructuredOutputsParams(json=tool.function.parameters),
                     f"tools[{i}].function.parameters")
    choice = body.effective_tool_choice()
    if choice in ("none", "auto"):
        return None
    chosen = [t for t in tools if not isinstance(choice, NamedToolChoice)
              or t.function.name == choice.function.name]
    specs: list[dict[str, Any]] = [
        {"name": t.function.name, "parameters": t.function.parameters} for t in chosen
    ]
    parallel = body.parallel_tool_calls and not isinstance(choice, NamedToolChoice)
    grammar = call_grammar(parser, specs, parallel=parallel)
    return _checked(StructuredOutputsParams(grammar=grammar), "tools")


def _checked(spec: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
    try:
        grammar_source(spec)
    except ValueError as exc:
        detail = str(exc).removeprefix("structured_outputs: ")
        raise APIError(400, f"{param}: {detail}", param=param, code="invalid_value") from None
    return spec
