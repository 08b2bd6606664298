"""`vllm serve` launch lines start `paged-server serve` unchanged: vLLM's flag
names parse into the same settings, unknown ones say what to use instead,
and a Hugging Face id already in the local HF cache is served offline."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from paged_server.default_model import ensure_default_model
from paged_server.entrypoints.cli import build_parser, main
from paged_server.entrypoints.openai.app import ServerSettings
from paged_server.entrypoints.openai.engine_args import engine_config_from_args
from paged_server.entrypoints.openai.frontend_args import settings_from_args
from paged_server.model_dir import resolve_model_dir

from .conftest import MODEL, start_server

pytestmark = pytest.mark.e2e

# As in vLLM's docs (quickstart, tool calling, reasoning outputs), with the
# flags the issue lists; only the model differs per line.
QWEN3 = ("serve Qwen/Qwen3-8B --max-num-seqs 16 -tp 2 --generation-config auto "
         "--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3 "
         "--max-logprobs 20 --disable-log-requests")
LLAMA = ("serve meta-llama/Llama-3.1-8B-Instruct --max-num-seqs 16 --tensor-parallel-size 2 "
         "--generation-config auto --enable-auto-tool-choice --tool-call-parser llama3_json "
         "--max-logprobs 20 --disable-log-requests --max-model-len 8192 --seed 0 "
         "--trust-remote-code --num-gpu-blocks-override 1024 --uvicorn-log-level warning "
         "--override-generation-config '{\"temperature\": 0.5}' --disable-log-stats")


@pytest.mark.parametrize("line", [QWEN3, LLAMA], ids=["qwen3", "llama"])
def test_vllm_launch_lines_parse_into_our_settings(line: str) -> None:
    args = build_parser().parse_args(shlex.split(line))
    config = engine_config_from_args(args)
    settings = settings_from_args(args, "m", None)
    assert args.model_tag == shlex.split(line)[1]
    assert config.max_batch_size == 16 and config.tensor_parallel_size == 2
    assert config.generation_config == "auto" and config.max_logprobs == 20
    assert settings.enable_auto_tool_choice and settings.log_requests is False
    if line is QWEN3:
        assert settings.tool_call_parser == "hermes" and settings.reasoning_parser == "qwen3"
        assert settings.log_stats is True
    else:
        assert settings.tool_call_parser == "llama3_json" and settings.reasoning_parser is None
        assert config.max_model_len == 8192 and config.num_gpu_blocks == 1024
        assert config.override_generation_config == {"temperature": 0.5}
        assert args.log_level == "warning" and settings.log_stats is False


def test_unknown_vllm_flags_say_what_to_use_instead(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--swap-space", "4", "--tensor-paralel-size", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--swap-space: no CPU swap: preempted requests are recomputed" in err
    assert "--tensor-paralel-size: did you mean --tensor-parallel-size?" in err
    with pytest.raises(SystemExit):
        main(["serve", "--enable-sleep-mode", "--kv-offloading-backend", "lmcache"])
    err = capsys.readouterr().err
    assert "--enable-sleep-mode: no sleep mode (/sleep, /wake_up)" in err
    assert "--kv-offloading-backend: KV blocks are offloaded by this server's own tiers" in err


def test_flags_whose_behaviour_is_on_here_are_accepted() -> None:
    args = build_parser().parse_args(["serve", "--enable-prompt-tokens-details",
                                      "--enable-server-load-tracking", "--return-tokens-as-token-ids"])
    assert settings_from_args(args, "m", None).return_tokens_as_token_ids
    assert not settings_from_args(build_parser().parse_args(["serve"]), "m", None).return_tokens_as_token_ids


def test_return_tokens_as_token_ids_is_the_servers_default() -> None:
    """``--return-tokens-as-token-ids``: logprob tokens are 'token_id:N' unless
    a request says false (vLLM's rule: the request field wins when set)."""
    srv = start_server(ServerSettings(model_name=MODEL, return_tokens_as_token_ids=True))
    try:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "logprobs": 1, "seed": 0}
        as_ids = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        tokens = as_ids["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == 3 and all(re.fullmatch(r"token_id:\d+", t) for t in tokens)
        top = as_ids["choices"][0]["logprobs"]["top_logprobs"][0]
        assert all(k.startswith("token_id:") for k in top)
        text = httpx.post(srv.url + "/v1/completions", timeout=60,
                          json={**body, "return_tokens_as_token_ids": False}).json()
        assert not any(t.startswith("token_id:") for t in text["choices"][0]["logprobs"]["tokens"])
        chat = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "logprobs": True, "top_logprobs": 1}).json()
        assert all(c["token"].startswith("token_id:") for c in chat["choices"][0]["logprobs"]["content"])
    finally:
        srv.stop()


@pytest.mark.parametrize("argv", [["--revision", "main"], ["--download-dir", "/tmp/x"],
                                  ["--load-format", "pt"]])
def test_download_flags_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert argv[0] in err
    assert "downloads nothing" in err or "safetensors" in err


def _fake_hf_cache(tmp_path: Path, repo_id: str) -> Path:
    """A Hugging Face hub cache holding ``repo_id`` as the default tiny model."""
    repo = tmp_path / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "snapshots").mkdir(parents=True)
    (repo / "snapshots" / "abc123").symlink_to(ensure_default_model(), target_is_directory=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    return tmp_path / "hub"


def test_hf_ids_resolve_only_from_the_local_cache(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(_fake_hf_cache(tmp_path, "Qwen/Qwen3-tiny")))
    assert resolve_model_dir("Qwen/Qwen3-tiny").endswith("snapshots/abc123")
    with pytest.raises(FileNotFoundError, match="downloads nothing.*huggingface-cli download Org/absent"):
        resolve_model_dir("Org/absent")


def test_qwen3_launch_line_starts_and_serves_offline(tmp_path: Path) -> None:
    """The Qwen3 line (one device: no -tp 2 on a CPU test) runs unchanged but for
    --port 0; its model id is found in the HF cache and is the served name."""
    argv = shlex.split(QWEN3.replace("Qwen/Qwen3-8B", "Qwen/Qwen3-tiny").replace(" -tp 2", ""))
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "HF_HUB_CACHE": str(_fake_hf_cache(tmp_path, "Qwen/Qwen3-tiny"))}
    proc = subprocess.Popen([sys.executable, "-m", "paged_server.entrypoints.cli", *argv, "--port", "0"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        url = None
        lines = []
        while url is None:
            line = proc.stderr.readline()
            assert line, f"server exited: {''.join(lines)}"
            lines.append(line)
            if m := re.search(r"serving 'Qwen/Qwen3-tiny' \(.*\) on (http://\S+) ", line):
                url = m.group(1)
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        chat: Any = client.chat.completions.create(
            model="Qwen/Qwen3-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            logprobs=True, top_logprobs=20,
        )
        assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 20
        assert hasattr(chat.choices[0].message, "reasoning_content")  # --reasoning-parser is on
    finally:
        proc.terminate()
        proc.wait(timeout=30)
