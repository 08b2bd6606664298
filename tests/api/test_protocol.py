"""Request validation: each bad field becomes a 400 that names it."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from paged_server.entrypoints.openai.errors import validation_error
from paged_server.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    normalize_prompt,
)


def error_for(model: Any, body: Any) -> tuple[str | None, str]:
    with pytest.raises(ValidationError) as exc:
        model.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.value.errors()]
    err = validation_error(RequestValidationError(errors))
    assert err.status == 400
    return err.param, err.message


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens", "must be an integer"),
        ({"prompt": "x", "max_tokens": -3}, "max_tokens", "must be >= 0, got -3"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "only allowed with echo"),
        ({"prompt": "x", "min_tokens": -1}, "min_tokens", "must be >= 0"),
        ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "token ids"),
        ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"prompt": "x", "temperature": -0.1}, "temperature", "must be >= 0"),
        ({"prompt": "x", "temperature": float("nan")}, "temperature", "finite number"),
        ({"prompt": "x", "top_p": 0}, "top_p", "must be > 0"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"prompt": "x", "stop": [""]}, "stop", "1..256"),
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"prompt": []}, "prompt", "must not be empty"),
        ({"prompt": [1, -2]}, "prompt", ">= 0"),
        ({"prompt": [1, "a"]}, "prompt", "list of token ids"),
        ({"prompt": ["a"] * 17}, "prompt", "at most 16"),
        ({}, "prompt", "field required"),
        ({"prompt": "x", "logprobs": -2}, "logprobs", "must be >= -1"),
        ({"prompt": "x", "best_of": 2}, "best_of", "must equal n or be omitted, got best_of 2 with n 1"),
        ({"prompt": "x", "use_beam_search": True, "stream": True}, "use_beam_search", "send stream=false"),
        ({"prompt": "x", "use_beam_search": True, "n": 3, "best_of": 2}, "best_of", "beam width must be >= n"),
        ({"prompt": "x", "use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping", "never"),
        ({"prompt": "x", "use_beam_search": "yes"}, "use_beam_search", "must be true or false"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
        ({"prompt": "x", "stream": "yes"}, "stream", "must be true or false"),
        ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "empty prompt"),
        ({"prompt": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "must be >= -1"),
        ({"prompt": "x", "truncation_side": "middle"}, "truncation_side", "'left' or 'right'"),
        ({"prompt": "x", "thinking_token_budget": 5}, "thinking_token_budget", "send null or -1"),
        ({"prompt": "x", "watermarking": True}, "watermarking", "send null or false"),
        ({"prompt": "x", "logprob_token_ids": [3]}, "logprob_token_ids", "not supported"),
        ({"prompt": "x", "stream_options": {"continuous_usage_stats": "yes"}},
         "stream_options.continuous_usage_stats", "must be true or false"),
    ],
)
def test_completion_request_errors_name_the_field(body: dict[str, Any], param: str, fragment: str) -> None:
    got_param, message = error_for(CompletionRequest, body)
    assert got_param == param
    assert fragment in message
    assert message.startswith(param)


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'user'"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0].type", "'text'"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
         "needs logprobs=true"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "tools[0].function", "field required"),
        ({"messages": [{"role": "user", "content": "x"}], "use_beam_search": True, "stream": True},
         "use_beam_search", "send stream=false"),
    ],
)
def test_chat_request_errors_name_the_field(body: dict[str, Any], param: str, fragment: str) -> None:
    got_param, message = error_for(ChatCompletionRequest, body)
    assert got_param == param
    assert fragment in message


def test_prompt_shapes_normalize() -> None:
    assert normalize_prompt("hi") == ["hi"]
    assert normalize_prompt([1, 2]) == [[1, 2]]
    assert normalize_prompt(["a", "b"]) == ["a", "b"]
    assert normalize_prompt([[1], [2, 3]]) == [[1], [2, 3]]


def test_valid_chat_request_keeps_text_parts() -> None:
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
         "max_completion_tokens": 5}
    )
    assert req.messages[0].text() == "ab"
    assert req.requested_max_tokens() == 5


def test_stream_options_and_optional_fields_parse_as_vllm() -> None:
    """vLLM's StreamOptions: continuous usage counts only with include_usage;
    null means the default for vLLM's optional fields; seed -1 is no seed."""
    def completion(**extra: Any) -> CompletionRequest:
        return CompletionRequest.model_validate({"prompt": "x", **extra})

    both = {"include_usage": True, "continuous_usage_stats": True}
    assert completion(stream=True, stream_options=both).continuous_usage()
    alone = completion(stream=True, stream_options={"continuous_usage_stats": True})
    assert not alone.include_usage() and not alone.continuous_usage()
    nulls = completion(stream=True, stream_options={"include_usage": None, "continuous_usage_stats": None})
    assert not nulls.include_usage()
    assert completion(stream_options={}).stream_options is not None  # empty: allowed without stream
    parsed = completion(n=None, stream=None, echo=None, presence_penalty=None, seed=-1)
    assert (parsed.n, parsed.stream, parsed.echo, parsed.presence_penalty, parsed.seed) == (1, False, False, 0.0, None)
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "logprobs": None, "parallel_tool_calls": None,
         "reasoning_effort": "minimal", "kv_transfer_params": {"a": 1}, "session_id": "s"})
    assert chat.logprobs is False and chat.parallel_tool_calls is True


def test_values_vllm_accepts_have_no_ceiling_here() -> None:
    """vLLM bounds temperature and repetition_penalty only from below, and n
    and best_of not at all (its engine's own limits refuse what cannot run):
    the same values parse here (the engine refuses n past max_num_seqs)."""
    request = CompletionRequest.model_validate(
        {"prompt": "x", "temperature": 3.5, "repetition_penalty": 25.0, "n": 17}
    )
    assert (request.temperature, request.repetition_penalty, request.n) == (3.5, 25.0, 17)
    beams = CompletionRequest.model_validate(
        {"prompt": "x", "use_beam_search": True, "n": 17, "best_of": 20}
    )
    assert (beams.n, beams.best_of) == (17, 20)
