"""`vllm serve`'s frontend flags on the HTTP side (scripted engine): response
role, chat template, auto tool choice, CORS, root path, HTTPS, the probes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from paged_server.entrypoints.cli import build_parser
from paged_server.entrypoints.openai.app import ServerSettings
from paged_server.entrypoints.openai.frontend_args import settings_from_args
from paged_server.entrypoints.openai.server import ServerThread

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _settings(*argv: str) -> ServerSettings:
    args = build_parser().parse_args(["serve", *argv])
    return settings_from_args(args, "fake-model", None)


def test_frontend_flags_shape_the_chat_reply(make_fake_engine: Any, tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m.content }}>>{% endfor %}")
    settings = _settings("--response-role", "bot", "--chat-template", str(template),
                         "--no-enable-auto-tool-choice")
    engine = make_fake_engine()
    with ServerThread(engine, settings) as srv:
        reply = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=30).json()
        assert reply["choices"][0]["message"]["role"] == "bot"
        # chats render with the flag's template
        tokens = httpx.post(srv.url + "/tokenize", json={"messages": CHAT["messages"]}).json()
        assert engine.tokenizer.decode(tokens["tokens"]) == "<<hi>>"
        with httpx.stream("POST", srv.url + "/v1/chat/completions",
                          json={**CHAT, "stream": True}, timeout=30) as resp:
            first = next(line for line in resp.iter_lines() if line.startswith("data: "))
        assert '"role":"bot"' in first
        auto = httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "tools": TOOLS}, timeout=30)
        assert auto.status_code == 400 and auto.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in auto.json()["error"]["message"]
        forced = {**CHAT, "tools": TOOLS, "tool_choice": "none"}
        assert httpx.post(srv.url + "/v1/chat/completions", json=forced, timeout=30).status_code == 200


def test_probes_model_card_and_load(fake_server: Any, make_fake_engine: Any) -> None:
    url = fake_server.url
    assert httpx.get(url + "/ping").status_code == 200
    assert httpx.post(url + "/ping").status_code == 200
    card = httpx.get(url + "/v1/models/fake-model").json()
    assert card["id"] == "fake-model" and card["object"] == "model" and card["max_model_len"] == 256
    missing = httpx.get(url + "/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(url + "/load").json() == {"server_load": 0}
    args = build_parser().parse_args(["serve", "--served-model-name", "main", "alias"])
    assert args.served_model_name == ["main", "alias"]
    settings = ServerSettings(model_name="main", model_aliases=("alias",))
    with ServerThread(make_fake_engine(), settings) as srv:  # vLLM accepts every served name
        assert [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]] == ["main", "alias"]
        body = {"model": "alias", "prompt": "x", "max_tokens": 1}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=30).status_code == 200
        assert httpx.post(srv.url + "/v1/completions", json={**body, "model": "other"}).status_code == 404


def test_cors_only_with_allowed_origins_and_root_path(make_fake_engine: Any) -> None:
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    with ServerThread(make_fake_engine(), _settings()) as srv:  # default: no CORS headers
        resp = httpx.options(srv.url + "/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in resp.headers
    settings = _settings("--allowed-origins", '["https://app.example"]', "--root-path", "/llm")
    with ServerThread(make_fake_engine(), settings) as srv:
        resp = httpx.options(srv.url + "/v1/completions", headers=preflight)
        assert resp.status_code == 200
        assert resp.headers["access-control-allow-origin"] == "https://app.example"
        # behind a proxy that strips /llm, the docs point at /llm/openapi.json
        assert "/llm/openapi.json" in httpx.get(srv.url + "/docs").text


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_ssl_flags_serve_https(make_fake_engine: Any, tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    settings = _settings("--ssl-keyfile", str(key), "--ssl-certfile", str(cert))
    with ServerThread(make_fake_engine(), settings) as srv:
        assert srv.url.startswith("https://")
        assert httpx.get(srv.url + "/health", verify=False).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(srv.url.replace("https://", "http://") + "/health", timeout=5)


def test_one_ssl_file_alone_is_refused() -> None:
    with pytest.raises(ValueError, match="both --ssl-keyfile and --ssl-certfile"):
        _settings("--ssl-keyfile", "k.pem")


def test_unset_sampling_fields_take_the_models_defaults(make_fake_engine: Any) -> None:
    engine = make_fake_engine()
    engine.default_sampling = {"temperature": 0.0, "top_k": 3, "repetition_penalty": 1.2, "max_tokens": 5}
    seen: list[Any] = []
    add = engine.add_request
    engine.add_request = lambda rid, prompt, params: (seen.append(params), add(rid, prompt, params))[1]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    with ServerThread(engine, ServerSettings(model_name="fake-model")) as srv:
        for body in (chat, {**chat, "temperature": 0.7, "top_k": -1, "max_tokens": 9},
                     {**chat, "use_beam_search": True, "n": 2}):
            assert httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    default, explicit, beams = seen
    assert (default.temperature, default.top_k, default.repetition_penalty, default.max_tokens) == (0.0, 3, 1.2, 5)
    assert (explicit.temperature, explicit.top_k, explicit.max_tokens) == (0.7, 0, 9)
    assert explicit.repetition_penalty == 1.2  # unset: still the model's
    assert beams.repetition_penalty == 1.0  # beam scores stay raw log-probabilities


def _scripted(engine: Any, pieces: list[str]) -> Any:
    """``engine`` (the fake) answering every request with these text deltas."""
    from paged_server.outputs import RequestOutput

    def step() -> list[RequestOutput]:
        outs = []
        for rid, req in list(engine.requests.items()):
            k = req.counts[0]
            req.counts[0] += 1
            done = k + 1 >= len(pieces)
            outs.append(RequestOutput(
                request_id=rid, index=0, new_token_ids=[5], new_text=pieces[k], new_logprobs=None,
                finished=done, finish_reason="stop" if done else None, error=None,
                num_prompt_tokens=len(req.prompt), num_generated_tokens=k + 1,
            ))
            if done:
                del engine.requests[rid]
        return outs

    engine.step = step
    return engine


def _stream_deltas(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    import json

    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(e)["choices"][0]["delta"] for e in events[:-1] if json.loads(e)["choices"]]


THOUGHT = ["<th", "ink>Let me", " think</th", "ink>\n\nThe answer", " is 4"]
CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'


def test_reasoning_parser_splits_the_thought(make_fake_engine: Any) -> None:
    settings = ServerSettings(model_name="fake-model", reasoning_parser="qwen3", tool_call_parser="hermes")
    with ServerThread(_scripted(make_fake_engine(), THOUGHT), settings) as srv:
        msg = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=30).json()["choices"][0]["message"]
        assert (msg["reasoning_content"], msg["content"]) == ("Let me think", "The answer is 4")
        deltas = _stream_deltas(srv.url, CHAT)
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me think"
        assert "".join(d.get("content") or "" for d in deltas) == "The answer is 4"
        hidden = httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "include_reasoning": False},
                            timeout=30).json()["choices"][0]["message"]
        assert hidden["reasoning_content"] is None and hidden["content"] == "The answer is 4"
    # the tool parser reads the content only: a call inside the thought is thought
    pieces = ["<think>maybe " + CALL, "</think>", CALL]
    with ServerThread(_scripted(make_fake_engine(), pieces), settings) as srv:
        choice = httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "tools": TOOLS},
                            timeout=30).json()["choices"][0]
        assert choice["message"]["reasoning_content"] == "maybe " + CALL
        assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["f"]
        deltas = _stream_deltas(srv.url, {**CHAT, "tools": TOOLS})
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "maybe " + CALL
        assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", []) if "name" in c["function"]] == ["f"]


@pytest.mark.parametrize(("parser", "text", "expected"), [
    ("qwen3", "<think>a</think>b", ("a", "b")),
    ("qwen3", "no thought", (None, "no thought")),
    ("qwen3", "<think>cut short", ("cut short", None)),
    ("deepseek_r1", "a</think>b", ("a", "b")),
    ("deepseek_r1", "<think>a</think>\nb", ("a", "b")),
    ("deepseek_r1", "all thought", ("all thought", None)),
])
def test_reasoning_split_streamed_in_any_pieces_equals_whole(parser: str, text: str, expected: Any) -> None:
    from paged_server.entrypoints.openai.reasoning import ReasoningStream, split_reasoning

    assert split_reasoning(parser, text) == expected
    for size in (1, 2, 3):
        stream, got = ReasoningStream(parser), ["", ""]
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for k, piece in enumerate(pieces):
            r, c = stream.feed(piece, final=k == len(pieces) - 1)
            got[0] += r
            got[1] += c
        assert (got[0] or None, got[1] or None) == expected, (size, got)


def test_add_special_tokens_and_request_logs(make_fake_engine: Any, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    from paged_server.tokenizer import Tokenizer

    engine = make_fake_engine()
    base = engine.tokenizer
    hf = HFTokenizer.from_str(base.hf.to_str())  # the same vocabulary, with a BOS post-processor
    hf.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    engine.tokenizer = Tokenizer(hf, chat_template=base.chat_template, special_tokens=base.special_tokens)
    settings = ServerSettings(model_name="fake-model", log_requests=True)

    def usage(srv: Any, path: str, body: dict[str, Any]) -> int:
        resp = httpx.post(srv.url + path, json={**body, "max_tokens": 1}, timeout=30)
        return int(resp.json()["usage"]["prompt_tokens"])

    with caplog.at_level(logging.INFO, logger="paged_server.entrypoints.openai"), \
            ServerThread(engine, settings) as srv:
        with_bos = usage(srv, "/v1/completions", {"prompt": "hello", "user": "alice"})
        without = usage(srv, "/v1/completions", {"prompt": "hello", "add_special_tokens": False})
        chat_plain = usage(srv, "/v1/chat/completions", {"messages": CHAT["messages"]})
        chat_bos = usage(srv, "/v1/chat/completions", {"messages": CHAT["messages"], "add_special_tokens": True})
    assert with_bos == without + 1 and chat_bos == chat_plain + 1
    assert "(user alice): prompt tokens" in caplog.text
