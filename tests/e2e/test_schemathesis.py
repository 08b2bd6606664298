"""Property-based fuzzing of the server's own OpenAPI schema (schemathesis):
valid and invalid bodies for every operation; never a 5xx, responses match
the documented status codes, content types and schemas; server stays up."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from .conftest import MODEL

pytestmark = pytest.mark.e2e

MAX_EXAMPLES = 30
MAX_TOKENS_CAP = 4  # keep generation short: the fuzzing is about the API, not the model
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


def cap_generation(case: Any, mode: GenerationMode) -> None:
    """At most MAX_TOKENS_CAP new tokens (chat's default would fill the context),
    and the rules across fields a JSON schema cannot state kept, so positive
    cases are valid: min_tokens <= max_tokens, max_tokens 0 only with echo,
    top_logprobs only with logprobs, logit_bias ids inside the vocabulary,
    the model the one served."""
    body = case.body
    if not isinstance(body, dict):
        return
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS_CAP
    if "input" in body and body.get("max_output_tokens") is None:  # /v1/responses
        body["max_output_tokens"] = MAX_TOKENS_CAP
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS_CAP:
            body[key] = MAX_TOKENS_CAP
    if mode is GenerationMode.POSITIVE:
        keep_cross_field_rules(body)


def keep_cross_field_rules(body: dict[str, Any]) -> None:
    if isinstance(body.get("model"), str):  # must name the served model (Anthropic's is required)
        body["model"] = MODEL
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if isinstance(body.get("min_tokens"), int) and isinstance(limit, int):
        body["min_tokens"] = min(body["min_tokens"], limit)
    if body.get("max_tokens") == 0 and "prompt" in body:
        body["echo"] = True
    if body.get("top_logprobs") and "messages" in body:
        body["logprobs"] = True
    if isinstance(body.get("logit_bias"), dict):
        body["logit_bias"] = {token_id(k): v for k, v in body["logit_bias"].items()}


def token_id(key: str) -> str:
    """A generated logit_bias key moved inside the vocabulary: its integer
    value where it has one, else its length (the schema allows any string key)."""
    try:
        return str(int(key) % 256)
    except ValueError:
        return str(len(key) % 256)


def operations(url: str) -> list[Any]:
    raw = httpx.get(url + "/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(raw)
    return [result.ok() for result in schema.get_all_operations()]


def fuzzer(op: Any, mode: GenerationMode, url: str, seen: dict[str, set[int]]) -> Any:
    """A hypothesis test of one operation, bounded to MAX_EXAMPLES cases."""

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        cap_generation(case, mode)
        response = case.call(base_url=url, timeout=60)
        seen.setdefault(op.label, set()).add(response.status_code)
        case.validate_response(response, checks=CHECKS)

    return fuzz


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzz_every_operation(server: Any, mode: GenerationMode) -> None:
    ops = operations(server.url)
    assert {op.label for op in ops} >= {"POST /v1/completions", "POST /v1/chat/completions",
                                         "GET /v1/models", "GET /health", "GET /metrics"}
    seen: dict[str, set[int]] = {}
    for op in ops:
        if mode is GenerationMode.NEGATIVE and (
            op.method.upper() in ("GET", "DELETE") or op.label == "POST /admin/reclaim"
        ):
            continue  # no parameters, or a path string: nothing can be made invalid
        fuzzer(op, mode, server.url, seen)()
    assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "ok"
    if mode is GenerationMode.NEGATIVE:  # invalid bodies were answered with 4xx
        assert any(400 <= s < 500 for s in seen["POST /v1/completions"])
    else:
        assert 200 in seen["POST /v1/completions"] and 200 in seen["POST /v1/chat/completions"]
        assert 200 in seen["POST /v1/responses"] and 200 in seen["POST /v1/messages"]
