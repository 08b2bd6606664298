"""Tensor parallelism across "nodes": two nodes of one rank each on loopback.

Node 0 runs the engine (``serve --nnodes 2``, or every rank under
torchrun); node 1 runs ``paged-server worker --node-rank 1``. Greedy
completions must equal one rank's, start-up without node 1 must fail naming
the missing rank, and SIGTERM must leave no process on either "node".
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from paged_server.config import EngineConfig
from paged_server.entrypoints.llm import LLM
from paged_server.parallel import WorkerStartError, executor, rendezvous
from paged_server.sampling_params import SamplingParams

FLAGS = ["--device", "cpu", "--dtype", "float32", "--attention-backend", "ref",
         "--max-model-len", "64", "--block-size", "4", "--num-gpu-blocks", "64"]  # fmt: skip
ENGINE = dict(device="cpu", dtype="float32", attention_backend="ref", max_model_len=64,
              block_size=4, num_gpu_blocks=64)  # fmt: skip
PROMPTS = ["Hello world", "The quick brown fox"]
URL = re.compile(r"on (http://127\.0\.0\.1:\d+) ")
CLI = [sys.executable, "-m", "paged_server.entrypoints.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _expected(model: str) -> list[str]:
    """One rank's greedy completions (the oracle)."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(model, **ENGINE) as llm:
        return [r.outputs[0].text for r in llm.generate(PROMPTS, params, use_tqdm=False)]


def _completions(url: str) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0.0,
                "ignore_eos": True}  # fmt: skip
        resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        texts.append(resp.json()["choices"][0]["text"])
    return texts


def _serving_url(proc: subprocess.Popen[str]) -> str:
    """Read the server's stderr up to its start-up line; return its URL."""
    assert proc.stderr is not None
    line = ""
    while "serving" not in line:
        line = proc.stderr.readline()
        assert line, "server exited before its start-up line"
    match = URL.search(line)
    assert match, line
    assert "tensor_parallel_size=2" in line
    return match[1]


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(p) for p in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" not in status.read_text()
    except OSError:
        return False


def _stop_all(procs: list[subprocess.Popen[str]], pids: list[int]) -> None:
    """SIGKILL what a failed test left, then check nothing outlived it."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "processes left behind"


def test_torchrun_env_and_rank_layout() -> None:
    env = rendezvous.torchrun_env(
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
         "MASTER_PORT": "1234"}  # fmt: skip
    )
    assert env == rendezvous.TorchrunEnv(3, 4, 1, "10.0.0.1", 1234)
    assert rendezvous.torchrun_env({"LOCAL_RANK": "0"}) is None
    assert rendezvous.node_ranks(4, 2, 1) == [2, 3]  # torchrun's order: node by node
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must be a multiple of nnodes \(2\)"):
        rendezvous.node_ranks(3, 2, 1)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(tensor_parallel_size=3, nnodes=2), r"nnodes: tensor_parallel_size \(3\) must be a multiple of nnodes \(2\)"),
        (dict(nnodes=0), r"nnodes: must be an integer >= 1, got 0"),
        (dict(master_port=70000), r"master_port: must be in 0\.\.65535, got 70000"),
    ],
)
def test_bad_node_settings_are_refused_in_one_line(fields: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields).validate()


def test_a_remote_rank_whose_heartbeat_stops_is_reported_silent() -> None:
    store = rendezvous.open_store("127.0.0.1", 0, None, True, 10.0)
    watch = rendezvous.HeartbeatWatch(store, [1, 2])
    assert watch.silent(0.2) == {}  # the first read only starts the clock
    deadline = time.monotonic() + 0.4
    while time.monotonic() < deadline:  # rank 1 beats, rank 2 has died
        rendezvous.heartbeat(store, 1)
        time.sleep(0.05)
        silent = watch.silent(0.2)
    assert list(silent) == [2] and silent[2] >= 0.2


_STOP_WATCH = """
import sys, time
import torch.distributed as dist
from paged_server.parallel import node_worker
node_worker.STOP_GRACE_S = 2.0
store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
stopped = node_worker._exit_on_stop("127.0.0.1", store.port, 1)
time.sleep(1.2)  # beats while rank 0 runs
del store  # rank 0 exits: its store stops answering
time.sleep(0.8)
if sys.argv[1] == "stop":  # this rank's own thread got the stop message meanwhile
    stopped.set()
time.sleep(node_worker.STOP_GRACE_S + 1.5)
print("still running", flush=True)
"""


@pytest.mark.parametrize("rank_stops", [True, False], ids=["stop_message", "rank0_crashed"])
def test_a_remote_rank_told_to_stop_exits_0_even_if_rank_0_is_gone_first(rank_stops: bool) -> None:
    """Rank 0 sends the stop message and exits; the remote rank's watcher can
    see the store gone before the rank's own thread has stopped. That rank
    must still end normally; with no stop message it exits 1 (rank 0 crashed)."""
    arg = "stop" if rank_stops else "crash"
    proc = subprocess.run([sys.executable, "-c", _STOP_WATCH, arg], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    if rank_stops:
        assert (proc.returncode, proc.stdout.strip()) == (0, "still running"), proc.stderr[-2000:]
    else:
        assert proc.returncode == 1 and "still running" not in proc.stdout


@pytest.mark.timeout(120, method="thread")
def test_start_up_names_the_ranks_that_never_joined(
    tp_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(executor, "START_TIMEOUT_S", 1.0)
    with pytest.raises(WorkerStartError) as info:
        LLM(str(tp_checkpoints["llama"]), tensor_parallel_size=2, nnodes=2,
            master_port=_free_port(), **ENGINE)  # fmt: skip
    message = str(info.value)
    assert "rank(s) 1 on node(s) 1 did not join within 1 s" in message
    assert "paged-server worker --nnodes 2" in message


# A node whose model directory is missing: loading its shard raises there.
BROKEN_NODE = """
import sys
import paged_server.models as models
def load_model(path, *args, **kwargs):
    raise FileNotFoundError(f"{path}: not on this node")
models.load_model = load_model
from paged_server.entrypoints.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(120, method="thread")
def test_a_failing_rank_on_another_node_ends_start_up_with_its_error(
    tp_checkpoints: dict[str, Path],
) -> None:
    port = _free_port()
    worker = subprocess.Popen(
        [sys.executable, "-c", BROKEN_NODE, "worker", "--master-port", str(port)],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        with pytest.raises(WorkerStartError) as info:
            LLM(str(tp_checkpoints["llama"]), tensor_parallel_size=2, nnodes=2,
                master_port=port, **ENGINE)  # fmt: skip
        assert "rank 1 (node 1) failed: FileNotFoundError:" in str(info.value)
        assert "not on this node" in str(info.value)
        assert worker.wait(timeout=30) == 1
    finally:
        _stop_all([worker], [worker.pid])


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_serve_on_two_nodes_matches_one_rank_and_sigterm_stops_both(
    tp_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    model = str(tp_checkpoints["llama"])
    expected = _expected(model)
    port = str(_free_port())
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Node 1 first: it waits for the engine's store, as a real node would.
    worker_log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen(
        [*CLI, "worker", "--master-port", port, "--nnodes", "2", "--node-rank", "1"],
        stderr=worker_log, text=True, env=env,
    )  # fmt: skip
    server = subprocess.Popen(
        [*CLI, "serve", "--model", model, "--port", "0", "--served-model-name", "tiny",
         "--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", port,
         "--shutdown-timeout", "1", "--log-level", "warning", *FLAGS],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
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


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists(),
                    reason="torchrun is not installed")  # fmt: skip
def test_serve_under_torchrun_matches_one_rank_and_sigterm_stops_every_rank(
    tp_checkpoints: dict[str, Path],
) -> None:
    model = str(tp_checkpoints["llama"])
    expected = _expected(model)
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    # Every rank runs the same command (torchrun's way); rank 0 serves, rank 1 works.
    server = subprocess.Popen(
        [torchrun, "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(_free_port()), "-m", "paged_server.entrypoints.cli", "serve",
         "--model", model, "--port", "0", "--served-model-name", "tiny",
         "--tensor-parallel-size", "2", "--shutdown-timeout", "1", "--log-level", "warning",
         *FLAGS],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    pids = [server.pid]
    try:
        url = _serving_url(server)
        pids += _descendants(server.pid)
        assert len(pids) >= 3, "torchrun and its two ranks"
        assert _completions(url) == expected
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)  # torchrun exits non-zero on a signal; what matters is what is left
    finally:
        _stop_all([server], pids)
