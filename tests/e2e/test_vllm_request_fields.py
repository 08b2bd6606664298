"""Every field of vLLM's completion and chat request models is honoured here
(a test shows its effect), refused with a 400 naming it, or accepted and
ignored for the reason ``IGNORED_FIELDS`` gives (vLLM ignores it too by
default); never silently dropped.

The field lists are vLLM's (``vllm/entrypoints/openai/protocol.py``:
``CompletionRequest`` and ``ChatCompletionRequest``, then the split
``completion/protocol.py`` and ``chat_completion/protocol.py`` of 2026 with
their newer fields), kept as data so a field added to them fails the walk
until it is handled."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.e2e.conftest import MODEL, start_server

from paged_server.entrypoints.openai.app import ServerSettings
from paged_server.entrypoints.openai.protocol import (
    IGNORED_FIELDS,
    REFUSED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
)

pytestmark = pytest.mark.e2e

VLLM_COMPLETION_FIELDS = [
    "model", "prompt", "prompt_embeds", "best_of", "echo", "frequency_penalty", "logit_bias",
    "logprobs", "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
    "suffix", "temperature", "top_p", "user", "use_beam_search", "top_k", "min_p",
    "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs", "add_special_tokens",
    "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id",
    "logits_processors", "return_tokens_as_token_ids", "cache_salt", "kv_transfer_params",
    "vllm_xargs", "structured_outputs",
    # newer vLLM
    "watermarking", "truncation_side", "logprob_token_ids", "session_id", "return_token_ids",
    "routed_experts_prompt_start", "return_token_offsets", "return_mm_kwargs",
    "ec_transfer_params", "repetition_detection", "thinking_token_budget", "stream_interval",
]
VLLM_CHAT_FIELDS = [
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
    "max_tokens", "max_completion_tokens", "n", "presence_penalty", "response_format", "seed",
    "stop", "stream", "stream_options", "temperature", "top_p", "tools", "tool_choice",
    "reasoning_effort", "include_reasoning", "parallel_tool_calls", "user", "best_of",
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs",
    "allowed_token_ids", "bad_words", "echo", "add_generation_prompt", "continue_final_message",
    "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
    "mm_processor_kwargs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern", "priority",
    "request_id", "logits_processors", "return_tokens_as_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "structured_outputs",
    # newer vLLM
    "thinking_token_budget", "watermarking", "truncation_side", "logprob_token_ids",
    "media_io_kwargs", "session_id", "return_token_ids", "routed_experts_prompt_start",
    "return_token_offsets", "return_prompt_text", "return_mm_kwargs", "ec_transfer_params",
    "repetition_detection", "stream_interval",
]

TESTS = Path(__file__).parent.parent
HERE = "tests/e2e/test_vllm_request_fields.py"
FRONT = "tests/api/test_vllm_frontend.py"
PRIORITY = "tests/e2e/test_priority_scheduling.py"
# Honoured field -> the test that shows its effect ("file::test").
EVIDENCE = {
    "model": "tests/e2e/test_bad_inputs.py::test_bad_request_gets_openai_error",
    "prompt": "tests/e2e/test_openai_client.py::test_max_tokens_is_respected_and_chat_default_fills_context",
    "messages": "tests/e2e/test_openai_client.py::test_chat_prompt_uses_the_checkpoint_template",
    "best_of": "tests/e2e/test_logprobs_api.py::test_beam_search_logprobs_bias_and_length_penalty_over_http",
    "use_beam_search": "tests/e2e/test_logprobs_api.py::test_beam_search_logprobs_bias_and_length_penalty_over_http",
    "length_penalty": "tests/e2e/test_logprobs_api.py::test_beam_search_logprobs_bias_and_length_penalty_over_http",
    "echo": "tests/e2e/test_logprobs_api.py::test_echo_scores_the_prompt_like_transformers",
    "logit_bias": "tests/e2e/test_logprobs_api.py::test_logit_bias_forces_a_token",
    "logprobs": "tests/e2e/test_logprobs_api.py::test_completion_top_logprobs",
    "top_logprobs": "tests/e2e/test_logprobs_api.py::test_chat_top_logprobs",
    "max_tokens": "tests/e2e/test_openai_client.py::test_max_tokens_is_respected_and_chat_default_fills_context",
    "max_completion_tokens": "tests/e2e/test_bad_inputs.py::test_bad_request_gets_openai_error",
    "n": "tests/e2e/test_openai_client.py::test_seed_makes_sampling_reproducible_and_n_gives_choices",
    "seed": "tests/e2e/test_openai_client.py::test_seed_makes_sampling_reproducible_and_n_gives_choices",
    "stop": "tests/e2e/test_openai_client.py::test_stop_string_cuts_the_text",
    "stream": "tests/e2e/test_openai_client.py::test_completion_stream_equals_non_stream_greedy",
    "stream_options": "tests/e2e/test_cached_tokens.py::test_streamed_usage_chunk_reports_cached_tokens",
    "suffix": "tests/api/test_protocol.py::test_completion_request_errors_name_the_field",
    "temperature": f"{FRONT}::test_unset_sampling_fields_take_the_models_defaults",
    "top_k": f"{FRONT}::test_unset_sampling_fields_take_the_models_defaults",
    "repetition_penalty": f"{FRONT}::test_unset_sampling_fields_take_the_models_defaults",
    "top_p": "tests/server/engine/test_sampler.py::test_top_p_keeps_the_smallest_set_reaching_p",
    "min_p": "tests/server/engine/test_sampler.py::test_min_p_is_relative_to_the_top_probability",
    "frequency_penalty": "tests/server/engine/test_sampler.py::test_penalties_match_hand_computation",
    "presence_penalty": "tests/server/engine/test_sampler.py::test_penalties_match_hand_computation",
    "stop_token_ids": f"{HERE}::test_stop_strings_and_tokens_with_include_stop_str_in_output",
    "include_stop_str_in_output": f"{HERE}::test_stop_strings_and_tokens_with_include_stop_str_in_output",
    "ignore_eos": "tests/e2e/test_openai_client.py::test_max_tokens_is_respected_and_chat_default_fills_context",
    "min_tokens": "tests/server/engine/test_sampler.py::test_min_tokens_masks_eos_and_stop_tokens_until_reached",
    "skip_special_tokens": f"{HERE}::test_token_sets_and_special_tokens",
    "allowed_token_ids": f"{HERE}::test_token_sets_and_special_tokens",
    "return_tokens_as_token_ids": f"{HERE}::test_token_sets_and_special_tokens",
    "bad_words": f"{HERE}::test_bad_words_are_never_generated",
    "truncate_prompt_tokens": f"{HERE}::test_prompt_logprobs_and_truncation",
    "prompt_logprobs": f"{HERE}::test_prompt_logprobs_and_truncation",
    "request_id": f"{HERE}::test_prompt_logprobs_and_truncation",
    "response_format": "tests/e2e/test_structured_and_tools.py::test_chat_json_schema_validates",
    "guided_json": f"{HERE}::test_guided_fields_and_structured_outputs_constrain_the_output",
    "guided_regex": f"{HERE}::test_guided_fields_and_structured_outputs_constrain_the_output",
    "guided_choice": f"{HERE}::test_guided_fields_and_structured_outputs_constrain_the_output",
    "guided_grammar": f"{HERE}::test_guided_fields_and_structured_outputs_constrain_the_output",
    "structured_outputs": f"{HERE}::test_guided_fields_and_structured_outputs_constrain_the_output",
    "add_special_tokens": f"{FRONT}::test_add_special_tokens_and_request_logs",
    "user": f"{FRONT}::test_add_special_tokens_and_request_logs",
    "tools": "tests/e2e/test_structured_and_tools.py::test_required_forces_a_valid_call",
    "tool_choice": "tests/e2e/test_structured_and_tools.py::test_required_forces_a_valid_call",
    # parallel_tool_calls=false is the one-call grammar call_grammar(parallel=False) builds
    "parallel_tool_calls": "tests/server/engine/test_structured_output.py::test_tool_call_grammars_force_a_parsable_call",
    "add_generation_prompt": "tests/e2e/test_openai_client.py::test_chat_prompt_uses_the_checkpoint_template",
    "continue_final_message": f"{HERE}::test_chat_template_fields_render_the_prompt",
    "documents": f"{HERE}::test_chat_template_fields_render_the_prompt",
    "chat_template": f"{HERE}::test_chat_template_fields_render_the_prompt",
    "chat_template_kwargs": f"{HERE}::test_chat_template_fields_render_the_prompt",
    "reasoning_effort": f"{HERE}::test_chat_template_fields_render_the_prompt",
    "include_reasoning": f"{FRONT}::test_reasoning_parser_splits_the_thought",
    # vLLM with a fast tokenizer (tokenizer.json) does not use it either: accepted, same output.
    "spaces_between_special_tokens": f"{HERE}::test_token_sets_and_special_tokens",
    "priority": f"{PRIORITY}::test_a_priority_0_request_sent_last_is_answered_before_the_priority_10_ones",
    "truncation_side": f"{HERE}::test_echo_and_usage_show_the_truncated_prompt",
    "return_token_ids": f"{HERE}::test_return_token_ids_and_prompt_text",
    "return_prompt_text": f"{HERE}::test_return_token_ids_and_prompt_text",
    "thinking_token_budget": f"{HERE}::test_refused_fields_are_a_400_naming_them",
    "watermarking": f"{HERE}::test_refused_fields_are_a_400_naming_them",
}
# Non-neutral values of the refused fields (and the neutral one they accept).
REFUSED_VALUES = {
    "prompt_embeds": "AAAA", "mm_processor_kwargs": {"x": 1}, "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " *", "structural_tag": "{}", "logits_processors": ["m.P"],
    "cache_salt": "salt", "media_io_kwargs": {"image": {"x": 1}},
    "logprob_token_ids": [1, 2], "thinking_token_budget": 5, "watermarking": True,
}
# Values vLLM accepts for the accepted-and-ignored fields.
IGNORED_VALUES = {
    "kv_transfer_params": {"do_remote_prefill": False}, "ec_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1}, "session_id": "s-1", "routed_experts_prompt_start": 2,
    "return_token_offsets": True, "return_mm_kwargs": False, "stream_interval": 4,
    "repetition_detection": {"max_pattern_size": 4, "min_pattern_size": 1, "min_count": 3},
}
CHAT = [{"role": "user", "content": "Tell me a story"}]


def _exists(ref: str) -> bool:
    path, name = ref.split("::")
    return f"def {name}(" in (TESTS.parent / path).read_text()


@pytest.mark.parametrize(("fields", "model"), [(VLLM_COMPLETION_FIELDS, CompletionRequest),
                                               (VLLM_CHAT_FIELDS, ChatCompletionRequest)],
                         ids=["completion", "chat"])
def test_every_vllm_field_is_honoured_or_refused(fields: list[str], model: Any) -> None:
    unhandled = [f for f in fields if f not in EVIDENCE and f not in REFUSED_VALUES
                 and f not in IGNORED_VALUES]
    assert not unhandled, f"vLLM fields neither honoured, refused nor ignored for a reason: {unhandled}"
    assert set(IGNORED_VALUES) == set(IGNORED_FIELDS)  # each ignored field has its reason
    for field in fields:
        if field in REFUSED_FIELDS:
            continue
        assert field in model.model_fields, f"{field} is not parsed (it would be ignored)"
        if field in EVIDENCE:
            assert _exists(EVIDENCE[field]), f"{field}: {EVIDENCE[field]} does not exist"


def test_ignored_fields_are_accepted(http: httpx.Client) -> None:
    for path, base in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT})):
        resp = http.post(path, json={**base, "max_tokens": 2, "temperature": 0, **IGNORED_VALUES})
        assert resp.status_code == 200, (path, resp.text)


def test_refused_fields_are_a_400_naming_them(http: httpx.Client) -> None:
    for field, value in REFUSED_VALUES.items():
        for path, base in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT})):
            resp = http.post(path, json={**base, "max_tokens": 1, field: value})
            assert resp.status_code == 400, (path, field, resp.text)
            err = resp.json()["error"]
            assert err["param"] == field and err["message"].startswith(f"{field}: not supported"), err
    ok = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "priority": 0, "cache_salt": None,
                                            "thinking_token_budget": -1, "watermarking": False})
    assert ok.status_code == 200


def _complete(http: httpx.Client, **body: Any) -> dict[str, Any]:
    resp = http.post("/v1/completions", json={"prompt": "Once upon a time", "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_stop_strings_and_tokens_with_include_stop_str_in_output(http: httpx.Client) -> None:
    full = _complete(http, max_tokens=12, ignore_eos=True)["choices"][0]["text"]
    stop = full[4:7]
    assert stop.strip() and full.find(stop) == 4, full
    cut = _complete(http, max_tokens=12, ignore_eos=True, stop=[stop])["choices"][0]
    kept = _complete(http, max_tokens=12, ignore_eos=True, stop=[stop],
                     include_stop_str_in_output=True)["choices"][0]
    assert (cut["text"], cut["finish_reason"]) == (full[:4], "stop")
    assert (kept["text"], kept["finish_reason"]) == (full[:7], "stop")
    # A stop token ends the text; with include_stop_str_in_output its text stays.
    ids = _complete(http, max_tokens=6, ignore_eos=True, logprobs=0, return_tokens_as_token_ids=True)
    tokens = [int(t.removeprefix("token_id:")) for t in ids["choices"][0]["logprobs"]["tokens"]]
    stop_id = tokens[2]
    ended = _complete(http, max_tokens=6, ignore_eos=True, stop_token_ids=[stop_id])["choices"][0]
    with_it = _complete(http, max_tokens=6, ignore_eos=True, stop_token_ids=[stop_id],
                        include_stop_str_in_output=True)["choices"][0]
    assert ended["finish_reason"] == "stop" and with_it["text"].startswith(ended["text"])
    assert len(with_it["text"]) > len(ended["text"])


def test_token_sets_and_special_tokens(http: httpx.Client) -> None:
    allowed = [300, 301, 302]
    body = _complete(http, max_tokens=8, ignore_eos=True, temperature=1.0, seed=3,
                     allowed_token_ids=allowed, logprobs=0, return_tokens_as_token_ids=True)
    tokens = body["choices"][0]["logprobs"]["tokens"]
    assert all(re.fullmatch(r"token_id:\d+", t) for t in tokens) and len(tokens) == 8
    assert {int(t.split(":")[1]) for t in tokens} <= set(allowed)
    # the only token allowed is <|im_start|> (a special token): its text shows only when asked
    special = dict(max_tokens=2, ignore_eos=True, allowed_token_ids=[1])
    assert _complete(http, **special)["choices"][0]["text"] == ""
    shown = _complete(http, **special, skip_special_tokens=False)["choices"][0]["text"]
    assert shown == "<|im_start|><|im_start|>"
    spaced = _complete(http, **special, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert spaced["choices"][0]["text"] == shown  # as vLLM's fast-tokenizer detokenizer
    bad = http.post("/v1/completions", json={"prompt": "x", "allowed_token_ids": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "allowed_token_ids"


def test_bad_words_are_never_generated(http: httpx.Client) -> None:
    first = _complete(http, max_tokens=1, logprobs=0, return_tokens_as_token_ids=True)
    first_id = int(first["choices"][0]["logprobs"]["tokens"][0].split(":")[1])
    word = first["choices"][0]["text"].strip()
    assert word, first
    banned = _complete(http, max_tokens=1, logprobs=0, return_tokens_as_token_ids=True, bad_words=[word])
    assert int(banned["choices"][0]["logprobs"]["tokens"][0].split(":")[1]) != first_id
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "temperature": 0,
                                                  "bad_words": [word]})
    assert chat.status_code == 200 and word not in chat.json()["choices"][0]["message"]["content"]


def test_prompt_logprobs_and_truncation(http: httpx.Client) -> None:
    body = _complete(http, max_tokens=1, prompt_logprobs=2, request_id="my-id-1")
    assert body["id"] == "cmpl-my-id-1"
    scores = body["choices"][0]["prompt_logprobs"]
    assert len(scores) == body["usage"]["prompt_tokens"] and scores[0] is None
    for entry in scores[1:]:
        assert 1 <= len(entry) <= 3
        assert all(set(v) == {"logprob", "rank", "decoded_token"} and v["logprob"] <= 0 for v in entry.values())
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0})
    assert chat.status_code == 200
    prompt_scores = chat.json()["prompt_logprobs"]
    assert len(prompt_scores) == chat.json()["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in prompt_scores[1:])  # 0 alternatives: the token itself
    streamed = http.post("/v1/completions", json={"prompt": "x", "prompt_logprobs": 1, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
    short = _complete(http, max_tokens=1, truncate_prompt_tokens=2)
    assert short["usage"]["prompt_tokens"] == 2
    chat_short = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1,
                                                        "truncate_prompt_tokens": 3})
    assert chat_short.json()["usage"]["prompt_tokens"] == 3


def test_guided_fields_and_structured_outputs_constrain_the_output(http: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"guided_regex": "[ab]{4}"}, lambda t: re.fullmatch("[ab]{4}", t)),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"guided_grammar": 'root ::= "x" "y"+'}, lambda t: re.fullmatch("xy+", t)),
        ({"guided_json": schema}, lambda t: isinstance(json.loads(t)["a"], bool)),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
        ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda t: re.fullmatch("[0-9]{3}", t)),
    ]
    for extra, ok in cases:
        text = _complete(http, max_tokens=48, **extra)["choices"][0]["text"]
        assert ok(text), (extra, text)
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 8,
                                                  "guided_choice": ["red", "blue"]})
    assert chat.json()["choices"][0]["message"]["content"] in ("red", "blue")
    two = http.post("/v1/completions", json={"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]})
    assert two.status_code == 400 and two.json()["error"]["param"] == "guided_choice"
    bad = http.post("/v1/completions", json={"prompt": "x", "guided_regex": "(("})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"


def _prompt_text(http: httpx.Client, **body: Any) -> str:
    """The rendered chat prompt, read back through prompt_logprobs (0 alternatives)."""
    resp = http.post("/v1/chat/completions", json={"max_tokens": 1, "prompt_logprobs": 0, **body})
    assert resp.status_code == 200, resp.text
    scores = resp.json()["prompt_logprobs"]
    return "".join(next(iter(e.values()))["decoded_token"] for e in scores[1:])


@pytest.fixture(scope="module")
def trusting_http() -> Iterator[httpx.Client]:
    """A server started with --trust-request-chat-template."""
    srv = start_server(ServerSettings(model_name=MODEL, trust_request_chat_template=True))
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c
    srv.stop()


def test_chat_template_fields_render_the_prompt(http: httpx.Client, trusting_http: httpx.Client) -> None:
    template = ("{{ documents[0].text }}|{{ flavor }}|{{ reasoning_effort }}|"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    fields = dict(messages=CHAT, chat_template=template, documents=[{"text": "doc one"}],
                  chat_template_kwargs={"flavor": "mint"}, reasoning_effort="low")
    text = _prompt_text(trusting_http, **fields)
    assert text.endswith(" one|mint|low|Tell me a story"), text  # "doc", the first token, has no score
    # vLLM's default: a request's template is refused unless the server trusts them
    refused = http.post("/v1/chat/completions", json={"max_tokens": 1, **fields})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    history = [*CHAT, {"role": "assistant", "content": "Once there was"}]
    closed = _prompt_text(http, messages=history, add_generation_prompt=False)
    open_ = _prompt_text(http, messages=history, add_generation_prompt=False, continue_final_message=True)
    assert open_.endswith("Once there was") and closed.startswith(open_) and len(closed) > len(open_)
    echo = http.post("/v1/chat/completions", json={"messages": history, "add_generation_prompt": False,
                                                  "continue_final_message": True, "echo": True,
                                                  "max_tokens": 3, "temperature": 0}).json()
    assert echo["choices"][0]["message"]["content"].startswith("Once there was")
    both = http.post("/v1/chat/completions", json={"messages": CHAT, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def _stream(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed response (the [DONE] line checked and dropped)."""
    resp = http.post(path, json={**body, "stream": True})
    assert resp.status_code == 200, resp.text
    lines = [line.removeprefix("data: ") for line in resp.text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# guidellm 0.8.1's streaming options (backends/openai/request_handlers.py), as vLLM's bench sends
GUIDELLM_STREAM = {"stream_options": {"include_usage": True, "continuous_usage_stats": True},
                   "stop": None, "ignore_eos": True}


@pytest.mark.parametrize(("path", "base"), [("/v1/completions", {"prompt": "Once upon a time", "n": 2}),
                                            ("/v1/chat/completions", {"messages": CHAT, "n": 2})],
                         ids=["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(
    http: httpx.Client, path: str, base: dict[str, Any]
) -> None:
    chunks = _stream(http, path, {**base, **GUIDELLM_STREAM, "max_tokens": 5, "temperature": 0})
    *deltas, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 10  # 2 choices x 5
    prompt = final["usage"]["prompt_tokens"]
    assert prompt > 0
    last: dict[int, int] = {}
    for chunk in deltas:  # each carries its choice's usage so far, as vLLM
        usage, index = chunk["usage"], chunk["choices"][0]["index"]
        assert usage["prompt_tokens"] == prompt, chunk
        assert usage["total_tokens"] == prompt + usage["completion_tokens"]
        assert usage["completion_tokens"] >= last.get(index, 0)
        last[index] = usage["completion_tokens"]
    assert last == {0: 5, 1: 5}
    # without continuous_usage_stats the chunks carry "usage": null, as before
    plain = _stream(http, path, {**base, "max_tokens": 3, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 6


def test_stop_reason_names_the_stop_token_or_string(http: httpx.Client) -> None:
    ids = _complete(http, max_tokens=6, ignore_eos=True, logprobs=0, return_tokens_as_token_ids=True)
    tokens = [int(t.removeprefix("token_id:")) for t in ids["choices"][0]["logprobs"]["tokens"]]
    by_token = _complete(http, max_tokens=6, ignore_eos=True, stop_token_ids=[tokens[2]])["choices"][0]
    assert (by_token["finish_reason"], by_token["stop_reason"]) == ("stop", tokens[2])
    full = _complete(http, max_tokens=12, ignore_eos=True)["choices"][0]
    assert (full["finish_reason"], full["stop_reason"]) == ("length", None)
    stop = full["text"][4:7]
    by_text = _complete(http, max_tokens=12, ignore_eos=True, stop=["zzzq", stop])["choices"][0]
    assert (by_text["finish_reason"], by_text["stop_reason"]) == ("stop", stop)
    streamed = _stream(http, "/v1/completions", {"prompt": "Once upon a time", "temperature": 0,
                                                 "max_tokens": 6, "ignore_eos": True,
                                                 "stop_token_ids": [tokens[2]]})
    assert streamed[-1]["choices"][0]["stop_reason"] == tokens[2]
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 8, "temperature": 0,
                                                  "ignore_eos": True, "logprobs": True,
                                                  "return_tokens_as_token_ids": True}).json()
    chat_ids = [int(t["token"].removeprefix("token_id:")) for t in chat["choices"][0]["logprobs"]["content"]]
    stopped = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 8, "temperature": 0,
                                                     "ignore_eos": True, "stop_token_ids": [chat_ids[1]]})
    assert stopped.json()["choices"][0]["stop_reason"] == chat_ids[1]
    chat_stream = _stream(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "temperature": 0,
                                                         "ignore_eos": True, "stop_token_ids": [chat_ids[1]]})
    assert chat_stream[-1]["choices"][0]["finish_reason"] == "stop"
    assert chat_stream[-1]["choices"][0]["stop_reason"] == chat_ids[1]


def test_stop_token_ids_outside_the_vocabulary_are_a_400(http: httpx.Client, server: Any) -> None:
    vocab = server.engine.model_config.vocab_size
    for path, base in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT})):
        resp = http.post(path, json={**base, "max_tokens": 2, "stop_token_ids": [5, vocab + 7]})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "stop_token_ids", err
        assert str(vocab + 7) in err["message"] and f"{vocab} tokens" in err["message"], err
    edge = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stop_token_ids": [vocab - 1]})
    assert edge.status_code == 200, edge.text


def test_echo_and_usage_show_the_truncated_prompt(http: httpx.Client, server: Any) -> None:
    tok = server.engine.tokenizer
    prompt = "Once upon a time there was a little cat who lived in a big house"
    ids = tok.encode(prompt)
    assert len(ids) > 6
    for side, kept in (("left", ids[-4:]), ("right", ids[:4])):
        body = _complete(http, prompt=prompt, max_tokens=2, echo=True, logprobs=0,
                         truncate_prompt_tokens=4, truncation_side=side)
        choice = body["choices"][0]
        assert body["usage"]["prompt_tokens"] == 4
        echoed = tok.decode(kept)
        assert choice["text"].startswith(echoed) and echoed != prompt, (side, choice["text"])
        assert choice["logprobs"]["token_logprobs"][:4][0] is None  # the echoed tokens: the kept 4
        assert len(choice["logprobs"]["tokens"]) == 4 + 2
        streamed = _stream(http, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "echo": True,
                                                     "temperature": 0, "truncate_prompt_tokens": 4,
                                                     "truncation_side": side})
        assert "".join(c["choices"][0]["text"] for c in streamed) == choice["text"]
    whole = _complete(http, prompt=prompt, max_tokens=1, echo=True, truncate_prompt_tokens=len(ids))
    assert whole["choices"][0]["text"].startswith(prompt)  # nothing cut: the text as sent
    fits = _complete(http, prompt=prompt, max_tokens=1, truncate_prompt_tokens=-1)
    assert fits["usage"]["prompt_tokens"] == len(ids)


def test_return_token_ids_and_prompt_text(http: httpx.Client, server: Any) -> None:
    tok = server.engine.tokenizer
    body = _complete(http, max_tokens=5, ignore_eos=True, return_token_ids=True)
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 5 and tok.decode(choice["token_ids"]) == choice["text"]
    assert choice["prompt_token_ids"] == tok.encode("Once upon a time")
    chunks = _stream(http, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 5,
                                               "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == choice["token_ids"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    rendered = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "temperature": 0,
                                                  "ignore_eos": True, "return_token_ids": True,
                                                  "return_prompt_text": True}).json()
    assert chat["prompt_text"] == rendered and chat["prompt_token_ids"] == tok.encode(rendered, add_special_tokens=False)
    assert tok.decode(chat["choices"][0]["token_ids"]) == chat["choices"][0]["message"]["content"]
    chat_chunks = _stream(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0,
                                                         "ignore_eos": True, "return_token_ids": True,
                                                         "return_prompt_text": True})
    assert chat_chunks[0]["prompt_text"] == rendered
    assert sum((c["choices"][0].get("token_ids", []) for c in chat_chunks), []) == chat["choices"][0]["token_ids"]


def test_null_means_the_default_for_vllms_optional_fields(http: httpx.Client) -> None:
    nulls = {"n": None, "stream": None, "frequency_penalty": None, "presence_penalty": None}
    done = _complete(http, max_tokens=2, echo=None, logprobs=None, **nulls)
    assert len(done["choices"]) == 1
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "logprobs": None,
                                                  "parallel_tool_calls": None, "reasoning_effort": "none",
                                                  "stream_options": None, **nulls})
    assert chat.status_code == 200, chat.text
    seeded = [_complete(http, max_tokens=4, temperature=1.0, seed=-1)["choices"][0]["text"] for _ in range(2)]
    assert all(isinstance(t, str) for t in seeded)  # -1: no seed, as vLLM (not a 400)
    empty = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "stream_options": {}})
    assert empty.status_code == 200, empty.text  # vLLM refuses only a non-empty one without stream


def test_reasoning_effort_sets_the_templates_enable_thinking(trusting_http: httpx.Client) -> None:
    """vLLM passes enable_thinking = (reasoning_effort != "none") unless
    chat_template_kwargs sets it (templates such as Gemma 4's need it)."""
    template = "{{ enable_thinking }}|{{ reasoning_effort }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    for effort, kwargs, expected in (("none", {}, "False|none|"), ("xhigh", {}, "True|xhigh|"),
                                     ("none", {"enable_thinking": True}, "True|none|")):
        resp = trusting_http.post("/v1/chat/completions", json={
            "messages": CHAT, "max_tokens": 1, "chat_template": template, "reasoning_effort": effort,
            "chat_template_kwargs": kwargs, "return_prompt_text": True})
        assert resp.status_code == 200, resp.text
        assert resp.json()["prompt_text"] == expected + CHAT[0]["content"], (effort, kwargs)
