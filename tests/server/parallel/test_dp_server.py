"""`paged-server serve --data-parallel-size 2` as an operator runs it: the real
CLI in a subprocess, two replica processes, HTTP on loopback, signals.

One server for the whole story, in order: a concurrent batch gives the
same greedy completions as one engine (``LLM`` in this process); requests
sharing a long prefix land on one replica (its prefix-cache hits and the
balancer's routing counter say so); a replica killed mid-serving fails only
its in-flight request, the other replica's request completes and later
requests go to it; SIGTERM leaves no process behind.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.server.parallel.test_tp_server import (
    FLAGS,
    _children,
    _cmdline,
    _flag_config,
    _reap,
    _wait_healthy,
)

from paged_server.entrypoints.llm import LLM
from paged_server.sampling_params import SamplingParams

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

DP_FLAGS = [*FLAGS, "--enforce-eager", "--max-batch-size", "8"]
STARTUP = re.compile(r"on (?P<url>http://127\.0\.0\.1:\d+) .*data_parallel_size=2: replicas \(pids (?P<a>\d+), (?P<b>\d+)\)")
PREFIX_TOKENS = 48  # 12 blocks of 4: every one a prefix-cache hit on the replica that has them


def _start_dp_server(model: str, extra: list[str] | None = None) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "paged_server.entrypoints.cli", "serve", "--model", model,
           "--port", "0", "--data-parallel-size", "2", "--shutdown-timeout", "1",
           "--served-model-name", "tiny", "--log-level", "warning", *DP_FLAGS, *(extra or [])]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    assert proc.stderr is not None
    line = ""
    while "serving" not in line:
        line = proc.stderr.readline()
        assert line, "server exited before its start-up line"
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe from filling
    return proc, line


def _metrics(url: str) -> dict[str, float]:
    """``name`` or ``name{replica}`` -> value, for the data-parallel samples."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        m = re.match(r"^paged:(\w+)(\{[^}]*\})? (\S+)$", line)
        if m:
            replica = re.search(r'replica="(\d+)"', m[2] or "")
            out[m[1] + (f"[{replica[1]}]" if replica else "")] = float(m[3])
    return out


def _complete(url: str, prompt: list[int], max_tokens: int = 12) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def test_serve_dp2(tp_checkpoints: dict[str, Path]) -> None:
    model = str(tp_checkpoints["llama"])
    rng = random.Random(0)
    batch = [[rng.randrange(1, 500) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(model, max_batch_size=8, enforce_eager=True, **_flag_config()) as llm:
        expected = [r.outputs[0].text for r in llm.generate([list(p) for p in batch], params, use_tqdm=False)]

    proc, line = _start_dp_server(model)
    descendants: list[int] = []
    try:
        match = STARTUP.search(line)
        assert match, line
        url, pids = match["url"], [int(match["a"]), int(match["b"])]
        _wait_healthy(url)
        descendants = _children(proc.pid)
        assert set(pids) <= set(descendants)

        # DP=2 gives DP=1's greedy tokens, for a batch sent at once.
        got: dict[int, httpx.Response] = {}
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _complete(url, batch[i])))
                   for i in range(len(batch))]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert [got[i].json()["choices"][0]["text"] for i in range(len(batch))] == expected
        m = _metrics(url)
        assert m["dp_replica_requests_routed_total[0]"] > 0 and m["dp_replica_requests_routed_total[1]"] > 0

        # Two groups of four sharing a long prefix: each group on one replica.
        before = _metrics(url)
        for _ in range(2):
            prefix = [rng.randrange(1, 500) for _ in range(PREFIX_TOKENS)]
            for k in range(4):
                assert _complete(url, [*prefix, 500 + k, 7, 9], max_tokens=2).status_code == 200
        after = _metrics(url)
        assert after["dp_requests_routed_by_prefix_total"] - before["dp_requests_routed_by_prefix_total"] == 6
        hits = [after[f"dp_replica_prefix_cache_hits_total[{i}]"] - before[f"dp_replica_prefix_cache_hits_total[{i}]"]
                for i in range(2)]  # fmt: skip
        assert hits == [3 * PREFIX_TOKENS, 3 * PREFIX_TOKENS], hits  # each group's last three hit

        # Kill the replica running a streamed request: only that one fails.
        stream_prompt = [rng.randrange(1, 500) for _ in range(9)]
        body = {"model": "tiny", "prompt": stream_prompt, "max_tokens": 200, "ignore_eos": True,
                "temperature": 0.0, "stream": True}  # fmt: skip
        events: list[str] = []
        results: dict[str, Any] = {}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            for sse in resp.iter_lines():
                if not sse.startswith("data: "):
                    continue
                events.append(sse)
                if len(events) == 1:  # it runs; start one more, which goes to the other replica
                    m = _metrics(url)
                    victim = 0 if m["dp_replica_num_requests_running[0]"] == 1 else 1
                    other = threading.Thread(target=lambda: results.__setitem__(
                        "other", _complete(url, [rng.randrange(1, 500) for _ in range(7)], 120)))
                    other.start()
                    survivor = f"dp_replica_num_requests_running[{1 - victim}]"
                    _await(lambda key=survivor: _metrics(url)[key] == 1)
                    os.kill(pids[victim], signal.SIGKILL)
        other.join(300)
        payloads = [json.loads(e[6:]) for e in events if e != "data: [DONE]"]
        errors = [p["error"]["message"] for p in payloads if "error" in p]
        assert errors and f"replica {victim}" in errors[0] and "SIGKILL" in errors[0], events[-3:]
        assert results["other"].status_code == 200, results["other"].text
        assert results["other"].json()["usage"]["completion_tokens"] == 120

        # Later requests go to the survivor; /health says a replica is dead
        # (503, as vLLM with a dead engine core), so an orchestrator restarts it.
        assert _complete(url, [5, 6, 7]).status_code == 200
        health = httpx.get(url + "/health", timeout=30)
        assert health.status_code == 503, health.text
        assert f"data-parallel replica {victim}" in health.json()["reason"] and "SIGKILL" in health.text
        m = _metrics(url)
        assert m["dp_replicas_alive"] == 1 and m[f"dp_replica_alive[{victim}]"] == 0

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        _reap(proc, descendants)


def _await(condition: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


def test_disconnect_aborts_on_the_replica_refusals_are_400s_and_sigterm_stops_all(
    tp_checkpoints: dict[str, Path],
) -> None:
    proc, line = _start_dp_server(str(tp_checkpoints["qwen3"]))
    descendants: list[int] = []
    try:
        match = STARTUP.search(line)
        assert match, line
        url = match["url"]
        _wait_healthy(url)
        descendants = _children(proc.pid)
        body = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 240, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            for sse in resp.iter_lines():
                if sse.startswith("data: "):
                    break  # the client goes away after its first token
        # The replica frees it long before 240 tokens could have been generated.
        _await(lambda: _metrics(url)["num_requests_running"] == 0, timeout=30)
        m = _metrics(url)
        assert m["dp_replicas_alive"] == 2 and m["generation_tokens_total"] < 200
        # A replica's refusal reaches the client as one engine's would: a 400.
        too_long = httpx.post(url + "/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": [7] * 300, "max_tokens": 4})  # fmt: skip
        assert too_long.status_code == 400, too_long.text
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
        # A server stopped while both replicas run stops them too.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        _reap(proc, descendants)


def _descendants(pid: int) -> list[int]:
    kids = _children(pid)
    return kids + [d for k in kids for d in _descendants(k)]


def test_serve_dp2_tp2_each_replica_its_own_ranks_and_a_dead_rank_fails_only_its_replica(tp_checkpoints: dict[str, Path]) -> None:
    """Two replicas of two tensor-parallel ranks each: DP=1 TP=1's tokens,
    each replica's rank 1 its own process; a killed rank fails only its
    replica's request; none left after SIGTERM."""
    model = str(tp_checkpoints["llama"])
    prompts = [[11, 12, 13, 14], [200, 3, 77], [5] * 20, [400, 401]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with LLM(model, max_batch_size=8, enforce_eager=True, **_flag_config()) as llm:
        expected = [r.outputs[0].text for r in llm.generate([list(p) for p in prompts], params, use_tqdm=False)]

    cmd_extra = ["--tensor-parallel-size", "2"]
    proc, line = _start_dp_server(model, cmd_extra)
    descendants: list[int] = []
    try:
        match = STARTUP.search(line)
        assert match, line
        url, pids = match["url"], [int(match["a"]), int(match["b"])]
        _wait_healthy(url)
        descendants = _descendants(proc.pid)
        for pid in pids:  # each replica spawned its own rank 1
            assert len([p for p in _children(pid) if "spawn_main" in _cmdline(p)]) == 1
        got: dict[int, httpx.Response] = {}
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _complete(url, prompts[i], 10)))
                   for i in range(len(prompts))]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert [got[i].json()["choices"][0]["text"] for i in range(len(prompts))] == expected
        m = _metrics(url)
        assert m["dp_replica_requests_routed_total[0]"] > 0 and m["dp_replica_requests_routed_total[1]"] > 0

        # A rank killed mid-stream takes down its replica only.
        body = {"model": "tiny", "prompt": [9, 8, 7], "max_tokens": 240, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            for sse in resp.iter_lines():
                if not sse.startswith("data: "):
                    continue
                events.append(sse)
                if len(events) == 1:
                    victim = 0 if _metrics(url)["dp_replica_num_requests_running[0]"] == 1 else 1
                    (rank1,) = [p for p in _children(pids[victim]) if "spawn_main" in _cmdline(p)]
                    os.kill(rank1, signal.SIGKILL)
        payloads = [json.loads(e[6:]) for e in events if e != "data: [DONE]"]
        errors = [p["error"]["message"] for p in payloads if "error" in p]
        assert errors and f"replica {victim}" in errors[0] and "paged-tp-rank1" in errors[0], events[-3:]
        assert got[0].status_code == 200 and _complete(url, [1, 2, 3]).status_code == 200
        health = httpx.get(url + "/health", timeout=30)
        assert health.status_code == 503 and f"data-parallel replica {victim}" in health.text
        assert _metrics(url)["dp_replicas_alive"] == 1

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        _reap(proc, descendants)


def test_a_replica_killed_while_starting_is_one_line_and_exit_2(
    tp_checkpoints: dict[str, Path],
) -> None:
    """The first replica dies while both load: the server says so in one
    line (before: an error that its requests failed, a warning that the
    other did not stop) and stops the other, which is still loading."""
    cmd = [sys.executable, "-m", "paged_server.entrypoints.cli", "serve", "--model",
           str(tp_checkpoints["llama"]), "--port", "0", "--data-parallel-size", "2",
           "--log-level", "warning", *DP_FLAGS]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    descendants: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(replicas := [p for p in _children(proc.pid) if "spawn_main" in _cmdline(p)]) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "replicas never started"
            time.sleep(0.02)
        descendants = _descendants(proc.pid)
        first = min(replicas)  # started first: the one the server waits on first
        time.sleep(0.5)  # importing torch, far from loaded
        os.kill(first, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        lines = [line for line in err.splitlines() if line.strip()]
        assert proc.returncode == 2, err
        assert len(lines) == 1 and f"(pid {first}) was killed by SIGKILL while starting" in lines[0], err
    finally:
        _reap(proc, descendants)


def test_a_replica_whose_server_gave_up_stops_quietly(
    tp_checkpoints: dict[str, Path], capfd: pytest.CaptureFixture[str]
) -> None:
    """A replica that finishes loading after the server closed its pipe
    (another replica failed to start) exits 0 without a traceback (it
    printed a BrokenPipeError's before)."""
    import torch.multiprocessing as mp

    from paged_server.config import EngineConfig
    from paged_server.data_parallel.replica import replica_main

    config = EngineConfig(model=str(tp_checkpoints["llama"]), enforce_eager=True, **_flag_config())
    context = mp.get_context("spawn")
    mine, theirs = context.Pipe()
    process = context.Process(target=replica_main, args=(0, config, theirs, 1))
    process.start()
    theirs.close()
    mine.close()  # the server gave up before this replica is ready
    process.join(120)
    err = capfd.readouterr().err
    assert process.exitcode == 0 and "Traceback" not in err, err
