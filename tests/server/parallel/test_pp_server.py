"""`paged-server serve --pipeline-parallel-size 2` as an operator runs it.

The real CLI in a subprocess, real HTTP. On one machine: greedy
completions equal one rank's, then the second stage's rank is killed while
a request streams: it fails naming the dead rank, later requests get 503,
and SIGTERM leaves no process. On two "nodes" (``--nnodes 2`` and
``paged-server worker --node-rank 1``, one stage each, loopback): the same
completions, and SIGTERM ends both nodes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from tests.server.parallel.test_multinode import (
    CLI,
    FLAGS,
    URL,
    _completions,
    _descendants,
    _expected,
    _free_port,
    _stop_all,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _serving_url(proc: subprocess.Popen[str]) -> str:
    """Read the server's stderr up to its start-up line; return its URL."""
    assert proc.stderr is not None
    line = ""
    while "serving" not in line:
        line = proc.stderr.readline()
        assert line, "server exited before its start-up line"
    match = URL.search(line)
    assert match, line
    assert "pipeline_parallel_size=2: layers split 1+1" in line, line
    return match[1]


def _serve(model: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*CLI, "serve", "--model", model, "--port", "0", "--served-model-name", "tiny",
         "--pipeline-parallel-size", "2", "--shutdown-timeout", "1", "--log-level", "warning",
         *FLAGS, *extra],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def test_serve_pp2_matches_one_rank_then_fails_cleanly_when_a_stage_dies(
    tp_checkpoints: dict[str, Path],
) -> None:
    model = str(tp_checkpoints["gemma3"])
    expected = _expected(model)
    server = _serve(model)
    pids = [server.pid]
    try:
        url = _serving_url(server)
        pids += _descendants(server.pid)
        assert _completions(url) == expected
        (stage1,) = [p for p in _descendants(server.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        body = {"model": "tiny", "prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            for sse in resp.iter_lines():
                if sse.startswith("data: "):
                    events.append(sse)
                    if len(events) == 2:
                        os.kill(stage1, signal.SIGKILL)
        errors = [json.loads(e[6:])["error"]["message"] for e in events if '"error"' in e]
        assert errors and "paged-tp-rank1" in errors[0] and "SIGKILL" in errors[0], events[-3:]
        after = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=30)
        assert after.status_code == 503 and "SIGKILL" in after.text
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        _stop_all([server], pids)


def test_serve_pp2_on_two_nodes_matches_one_rank_and_sigterm_stops_both(
    tp_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    model = str(tp_checkpoints["llama"])
    expected = _expected(model)
    port = str(_free_port())
    worker_log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen(  # node 1 first: it waits for the engine's store
        [*CLI, "worker", "--master-port", port, "--nnodes", "2", "--node-rank", "1"],
        stderr=worker_log, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    server = _serve(model, "--nnodes", "2", "--master-port", port)
    pids = [worker.pid, server.pid]
    try:
        url = _serving_url(server)
        pids += _descendants(worker.pid) + _descendants(server.pid)
        assert _completions(url) == expected
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) in (0, -signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, (tmp_path / "worker.log").read_text()[-2000:]
    finally:
        _stop_all([server, worker], pids)


TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))


@pytest.mark.slow
@pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun is not installed")
def test_tp2_by_pp2_under_torchrun_on_two_nodes_matches_one_rank(
    tp_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """vLLM's multi-node shape: TP inside a node, PP across nodes. Two
    torchrun agents (node 0 and node 1, two ranks each) run the same
    command; node 1's ranks are the second stage."""
    model = str(tp_checkpoints["qwen3"])
    expected = _expected(model)
    port = str(_free_port())
    command = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", port, "-m", "paged_server.entrypoints.cli", "serve",
               "--model", model, "--port", "0", "--served-model-name", "tiny", "-tp", "2",
               "-pp", "2", "--shutdown-timeout", "1", "--log-level", "warning", *FLAGS]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    node1 = subprocess.Popen([TORCHRUN, "--node-rank", "1", *command],
                             stderr=(tmp_path / "node1.log").open("w"), text=True, env=env)  # fmt: skip
    node0 = subprocess.Popen([TORCHRUN, "--node-rank", "0", *command],
                             stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    pids = [node0.pid, node1.pid]
    try:
        url = _serving_url(node0)
        pids += _descendants(node0.pid) + _descendants(node1.pid)
        assert len(pids) >= 6, "two agents and their four ranks"
        assert _completions(url) == expected
        node0.send_signal(signal.SIGTERM)
        node0.wait(timeout=60)  # torchrun exits non-zero on a signal; what matters is what is left
        node1.wait(timeout=60)  # its ranks exit once node 0's store is gone
    finally:
        _stop_all([node0, node1], pids)
