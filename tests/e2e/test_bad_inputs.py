"""Every kind of bad input gets a 4xx with an OpenAI error body naming the
problem, and the server keeps serving afterwards."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from .conftest import MAX_SEQ_LEN, MODEL, start_server

pytestmark = pytest.mark.e2e

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
LONG_PROMPT = "hello " * 400  # far more than MAX_SEQ_LEN tokens


CASES: list[tuple[str, str, Any, int, str | None, str]] = [
    # (id, path, json body, status, param, message fragment)
    ("unknown-model", COMP, {"model": "gpt-9", "prompt": "x"}, 404, "model", "'gpt-9' is not served"),
    ("unknown-model-chat", CHAT, {"model": "gpt-9", "messages": MSG}, 404, "model", "not served"),
    ("max-tokens-string", COMP, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "must be an integer"),
    ("temperature-string", COMP, {"prompt": "x", "temperature": "hot"}, 400, "temperature", "must be a number"),
    ("prompt-object", COMP, {"prompt": {"a": 1}}, 400, "prompt", "must be a string"),
    ("messages-string", CHAT, {"messages": "hi"}, 400, "messages", "must be a list"),
    ("stream-string", COMP, {"prompt": "x", "stream": "yes"}, 400, "stream", "must be true or false"),
    ("negative-max-tokens", COMP, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", ">= 0"),
    ("zero-max-tokens", CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("huge-max-tokens", COMP, {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens", f"max_model_len {MAX_SEQ_LEN}"),
    ("huge-max-completion-tokens", CHAT, {"messages": MSG, "max_completion_tokens": 10**6}, 400,
     "max_completion_tokens", "max_model_len"),
    ("negative-temperature", COMP, {"prompt": "x", "temperature": -0.5}, 400, "temperature", ">= 0"),
    ("top-p-zero", COMP, {"prompt": "x", "top_p": 0}, 400, "top_p", "must be > 0"),
    ("n-too-large", COMP, {"prompt": "x", "n": 100}, 400, "n", "(max_batch_size), got 100"),
    ("prompt-too-long", COMP, {"prompt": LONG_PROMPT}, 400, "prompt", f"but max_model_len is {MAX_SEQ_LEN}"),
    ("messages-too-long", CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400,
     "messages", f"but max_model_len is {MAX_SEQ_LEN}"),
    ("empty-prompt", COMP, {"prompt": ""}, 400, "prompt", "must not be empty"),
    ("empty-token-list", COMP, {"prompt": []}, 400, "prompt", "must not be empty"),
    ("empty-messages", CHAT, {"messages": []}, 400, "messages", "at least 1"),
    ("missing-prompt", COMP, {"max_tokens": 3}, 400, "prompt", "field required"),
    ("too-many-stops", COMP, {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ("token-id-out-of-vocab", COMP, {"prompt": [1, 10**7]}, 400, "prompt", "outside the vocabulary"),
    ("negative-token-id", COMP, {"prompt": [1, -5]}, 400, "prompt", ">= 0"),
    ("top-logprobs", COMP, {"prompt": "x", "logprobs": 21}, 400, "logprobs", "must be <= 20"),
    ("max-tokens-0", COMP, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "only allowed with echo"),
    ("logit-bias-range", COMP, {"prompt": "x", "logit_bias": {"3": -150}}, 400, "logit_bias", "[-100, 100]"),
    ("logit-bias-vocab", COMP, {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias",
     "outside the vocabulary"),
    ("min-tokens", COMP, {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens",
     "must be <= 2"),
    ("beam-search-stream", CHAT, {"messages": MSG, "use_beam_search": True, "stream": True}, 400,
     "use_beam_search", "send stream=false"),
    ("image-content", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content[0].type", "'text'"),
    ("bad-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "'user'"),
    ("stream-options-without-stream", COMP, {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options", "stream is true"),
    ("body-is-a-list", COMP, [1, 2], 400, None, "JSON object"),
    ("top-k-beyond-int64", COMP, {"prompt": "x", "top_k": 2**63}, 400, "top_k", "<= 9223372036854775807"),
    ("logit-bias-superscript-key", COMP, {"prompt": "x", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias",
     "token ids"),
    ("logit-bias-arabic-digit-key", CHAT, {"messages": MSG, "logit_bias": {"\u0663": 1}}, 400, "logit_bias",
     "token ids"),
    ("json-object-min-tokens", CHAT, {"messages": MSG, "max_tokens": 60, "min_tokens": 50,
                                      "response_format": {"type": "json_object"}}, 400, "min_tokens",
     "response_format"),
    ("json-schema-without-schema", CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}}, 400,
     "response_format", "type json_schema needs"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "fragment"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_gets_openai_error(http: httpx.Client, path: str, body: Any, status: int,
                                       param: str | None, fragment: str) -> None:
    resp = http.post(path, json=body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert fragment in err["message"], err["message"]
    assert err["type"] == "invalid_request_error"


# JSON text with a lone surrogate escape (valid JSON, not encodable text).
SURROGATE_BODIES = [
    ("prompt", COMP, b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("prompt-list", COMP, b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt[1]"),
    ("chat-content", CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800"}]}',
     "messages[0].content"),
    ("chat-content-part", CHAT,
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages[0].content[0].text"),
    ("stop", COMP, b'{"prompt": "x", "stop": "\\ud800"}', "stop"),
]


@pytest.mark.parametrize(("path", "raw", "param"), [c[1:] for c in SURROGATE_BODIES],
                         ids=[c[0] for c in SURROGATE_BODIES])
def test_lone_surrogate_is_400_naming_the_field(http: httpx.Client, path: str, raw: bytes,
                                                param: str) -> None:
    resp = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param
    assert "surrogate" in err["message"] and err["message"].startswith(f"{param}: "), err


def test_messages_name_the_field_once(http: httpx.Client) -> None:
    err = http.post(CHAT, json={"messages": MSG, "response_format": {"type": "json_schema"}}).json()["error"]
    assert err["message"].count("response_format") == 1, err["message"]


@pytest.fixture(scope="module")
def small_pool() -> Any:
    srv = start_server(num_gpu_blocks=4, block_size=16)
    yield srv
    srv.stop()


def test_too_big_for_the_pool_keeps_the_whole_message(small_pool: Any) -> None:
    with httpx.Client(base_url=small_pool.url, timeout=60) as c:
        resp = c.post(COMP, json={"prompt": [1] * 20, "max_tokens": 100})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert "prompt has 20 tokens and max_tokens is 100: the sequence needs 8 KV blocks" in err["message"]
    assert err["param"] == "prompt"


def test_prompt_too_long_states_both_numbers(http: httpx.Client, server: Any) -> None:
    n = len(server.engine.tokenizer.encode(LONG_PROMPT))
    err = http.post(COMP, json={"prompt": LONG_PROMPT}).json()["error"]
    assert f"prompt has {n} tokens but max_model_len is {MAX_SEQ_LEN}" in err["message"]


@pytest.mark.parametrize("raw", [b"{not json", b'{"prompt": "x",}', b"", b"\xff\xfe"])
def test_malformed_json_is_400(http: httpx.Client, raw: bytes) -> None:
    resp = http.post(COMP, content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert "not valid JSON" in message or "missing" in message


def test_json_without_content_type_says_what_to_send(http: httpx.Client) -> None:
    resp = http.post(COMP, content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    assert resp.status_code == 400
    assert "Content-Type: application/json" in resp.json()["error"]["message"]


def test_body_over_one_mib_is_413(http: httpx.Client) -> None:
    resp = http.post(COMP, json={"prompt": "x" * (1 << 20)})
    assert resp.status_code == 413
    assert "over the limit of 1048576 bytes" in resp.json()["error"]["message"]


def test_unknown_path_and_wrong_method_get_json_errors(http: httpx.Client) -> None:
    assert http.get("/v1/nothing").json()["error"]["message"].startswith("no such endpoint")
    resp = http.get(COMP)
    assert resp.status_code == 405 and "error" in resp.json()


def test_server_still_serves_after_bad_inputs(http: httpx.Client) -> None:
    for _, path, body, *_ in CASES:
        http.post(path, json=body)
    assert http.get("/health").json() == {"status": "ok", "audit": []}
    ok = http.post(COMP, json={"model": MODEL, "prompt": "still there?", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
