"""`paged-server serve --tensor-parallel-size 2` as an operator runs it: the
real CLI in a subprocess, the real `openai` client, signals.

One server per test module run: first the same greedy completions as
TP=1 (``LLM.generate`` in this process), then a worker is killed while two
requests are in flight: both fail with a message naming the dead rank, the
next request gets 503, /health reports unhealthy, and SIGTERM ends the
server with no process left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from paged_server.entrypoints.llm import LLM
from paged_server.sampling_params import SamplingParams

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

FLAGS = ["--device", "cpu", "--dtype", "float32", "--attention-backend", "ref",
         "--max-model-len", "256", "--block-size", "4", "--num-gpu-blocks", "256"]  # fmt: skip
STARTUP = re.compile(
    r"on (?P<url>http://127\.0\.0\.1:\d+) .*KV cache \S+ \(kv_cache_dtype=\w+\): capacity (?P<tokens>\d+) tokens"
)
PROMPTS = ["Hello world", "The quick brown fox", "def main():"]


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(p) for p in (task / "children").read_text().split()]
    return kids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()


def _wait_healthy(url: str) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server never became healthy"
        time.sleep(0.1)


def _start_tp_server(model: str) -> tuple[subprocess.Popen[str], str]:
    """``serve --tensor-parallel-size 2`` in a subprocess; returns it and its
    start-up line (the engine logs before that line)."""
    cmd = [sys.executable, "-m", "paged_server.entrypoints.cli", "serve", "--model", model,
           "--port", "0", "--tensor-parallel-size", "2", "--shutdown-timeout", "1",
           "--served-model-name", "tiny", "--log-level", "warning", *FLAGS]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    assert proc.stderr is not None
    line = ""
    while "serving" not in line:
        line = proc.stderr.readline()
        assert line, "server exited before its start-up line"
    return proc, line


def _reap(proc: subprocess.Popen[str], descendants: list[int]) -> None:
    """Kill ``proc`` if it is still up, then check none of its children outlived it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in descendants) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in descendants if _alive(p)], "processes left behind"


def test_serve_tp2_matches_tp1_then_survives_a_dead_worker(tp_checkpoints: dict[str, Path]) -> None:
    model = str(tp_checkpoints["llama"])
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(model, max_batch_size=8, **_flag_config()) as llm:
        expected = [r.outputs[0].text for r in llm.generate(PROMPTS, params, use_tqdm=False)]

    proc, line = _start_tp_server(model)
    descendants: list[int] = []
    try:
        match = STARTUP.search(line)
        assert match, line
        assert "tensor_parallel_size=2: each rank holds 1 of 2 KV heads per layer" in line
        assert "pool holds 2x the tokens" in line
        url = match["url"]
        _wait_healthy(url)
        descendants = _children(proc.pid)
        workers = [p for p in descendants if "spawn_main" in _cmdline(p)]
        assert len(workers) == 1, [_cmdline(p) for p in descendants]

        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        for prompt, text in zip(PROMPTS, expected, strict=True):
            got = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=16, temperature=0.0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert got.choices[0].text == text

        # Two requests in flight, then rank 1 dies.
        results: dict[str, Any] = {}

        def complete() -> None:
            body = {"model": "tiny", "prompt": "long one", "max_tokens": 240, "ignore_eos": True}
            results["plain"] = httpx.post(url + "/v1/completions", json=body, timeout=60)

        plain = threading.Thread(target=complete)
        plain.start()
        time.sleep(0.2)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 240, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            for sse in resp.iter_lines():
                if not sse.startswith("data: "):
                    continue
                events.append(sse)
                if len(events) == 2:
                    os.kill(workers[0], signal.SIGKILL)
        plain.join(60)
        errors = [json.loads(e[6:])["error"]["message"] for e in events if '"error"' in e]
        assert errors and "paged-tp-rank1" in errors[0] and "SIGKILL" in errors[0], events[-3:]
        assert results["plain"].status_code == 500
        assert "SIGKILL" in results["plain"].json()["error"]["message"]

        after = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=30)
        assert after.status_code == 503 and "SIGKILL" in after.text
        health = httpx.get(url + "/health", timeout=30)
        assert health.status_code == 503 and "SIGKILL" in health.json()["reason"]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        _reap(proc, descendants)


def test_sigterm_stops_a_healthy_tp_server_and_its_workers(tp_checkpoints: dict[str, Path]) -> None:
    proc, line = _start_tp_server(str(tp_checkpoints["qwen3"]))
    descendants: list[int] = []
    try:
        match = STARTUP.search(line)
        assert match, line
        _wait_healthy(match["url"])
        descendants = _children(proc.pid)
        assert any("spawn_main" in _cmdline(p) for p in descendants)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        _reap(proc, descendants)


def _flag_config() -> dict[str, Any]:
    """FLAGS as ``LLM`` keyword arguments."""
    pairs = zip(FLAGS[::2], FLAGS[1::2], strict=True)
    return {
        flag[2:].replace("-", "_"): (int(v) if v.isdigit() else v) for flag, v in pairs
    }
