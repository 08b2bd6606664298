"""Tensor-parallel start-up fails fast, in one line, and leaves no process.

A size the model or the machine cannot take is refused before any worker
starts; a worker that dies before its handshake ends start-up with its own
error instead of leaving rank 0 waiting for it forever.
"""

from __future__ import annotations

import multiprocessing.context
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from paged_server.entrypoints.llm import LLM
from paged_server.parallel import WorkerStartError

# The bug was a hang inside torch.distributed's C++ code, where a signal
# cannot interrupt it: the thread method ends the run with every stack.
pytestmark = pytest.mark.timeout(180, method="thread")

ENGINE: dict[str, Any] = dict(
    device="cpu", dtype="float32", attention_backend="ref", max_model_len=64,
    kv_cache_backend="paged", block_size=4, num_gpu_blocks=24,
)  # fmt: skip


def _spawned_children() -> list[str]:
    """Command lines of this process's live spawned children (the workers;
    multiprocessing's resource tracker is no worker)."""
    found = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue  # gone meanwhile
            if "--multiprocessing-fork" in cmdline and "resource_tracker" not in cmdline:
                found.append(f"{pid}: {cmdline}")
    return found


@pytest.fixture
def no_spawning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting a worker process fails the test (and starts nothing)."""

    def start(self: Any) -> None:
        raise AssertionError(f"a worker process was started for {self.name}")

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start)


@pytest.mark.usefixtures("no_spawning")
@pytest.mark.parametrize(
    ("tp", "message"),
    [
        (3, "num_attention_heads (4) is not divisible by tensor_parallel_size (3)"),
        (1000, "num_attention_heads (4) is not divisible by tensor_parallel_size (1000)"),
    ],
)
def test_a_size_the_heads_do_not_split_by_is_refused_before_any_worker_starts(
    tp_checkpoints: dict[str, Path], tp: int, message: str
) -> None:
    with pytest.raises(ValueError, match=r"^[^\n]*$") as info:
        LLM(str(tp_checkpoints["llama"]), tensor_parallel_size=tp, **ENGINE)
    assert message in str(info.value)


@pytest.mark.usefixtures("no_spawning")
def test_more_ranks_than_cpu_cores_is_refused_before_any_worker_starts(
    tp_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 4 ranks split this model's heads (KV heads replicated); two cores cannot run them.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=4 needs a CPU core per rank .* at most 2$"
    ):
        LLM(str(tp_checkpoints["llama"]), tensor_parallel_size=4, **ENGINE)


def test_a_worker_that_dies_before_its_handshake_fails_start_up_with_its_error(
    tp_checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broken install only the worker sees: a package it imports raises.
    Spawn hands this process's sys.path to the worker; this process imported
    the real package before the shadow went first on the path."""
    broken = tmp_path / "shadow" / "paged_ref"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('paged_ref is broken on this rank')\n")
    monkeypatch.syspath_prepend(str(broken.parent))
    with pytest.raises(WorkerStartError) as info:
        LLM(str(tp_checkpoints["llama"]), tensor_parallel_size=2, **ENGINE)
    assert "paged-tp-rank1" in str(info.value)
    assert "ImportError: paged_ref is broken on this rank" in str(info.value)
    assert not _spawned_children(), "a worker outlived the failed start-up"
    assert not multiprocessing.active_children()


def _run_script(
    source: str, tmp_path: Path, model: Path, from_stdin: bool
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(source.replace("MODEL", repr(str(model))))
    cmd = [sys.executable, "-"] if from_stdin else [sys.executable, str(script)]
    with script.open() as stdin:
        return subprocess.run(
            cmd, stdin=stdin if from_stdin else subprocess.DEVNULL, capture_output=True,
            text=True, timeout=150, cwd=tmp_path,
        )  # fmt: skip


SCRIPT = f"""
from paged_server.entrypoints.llm import LLM
llm = LLM(MODEL, tensor_parallel_size=2, **{ENGINE!r})
print("started")
"""


def test_a_script_read_from_stdin_is_told_to_use_a_file_with_a_main_guard(
    tp_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    done = _run_script(SCRIPT, tmp_path, tp_checkpoints["llama"], from_stdin=True)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "read from <stdin>" in last
    assert 'if __name__ == "__main__":' in last


@pytest.mark.slow
def test_a_script_without_a_main_guard_fails_start_up_naming_the_guard(
    tp_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Spawn runs the script again in the worker, which tries to start its
    own workers while bootstrapping and dies before reaching our code."""
    done = _run_script(SCRIPT, tmp_path, tp_checkpoints["llama"], from_stdin=False)
    assert done.returncode != 0
    assert "started" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert "WorkerStartError" in last and "paged-tp-rank1" in last and "before it started" in last
    assert 'if __name__ == "__main__":' in last


def test_serve_refuses_a_size_the_heads_do_not_split_by_in_one_line(
    tp_checkpoints: dict[str, Path],
) -> None:
    cmd = [sys.executable, "-m", "paged_server.entrypoints.cli", "serve", "--model",
           str(tp_checkpoints["llama"]), "--tensor-parallel-size", "3", "--device", "cpu",
           "--port", "0", "--max-model-len", "256"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "paged-server serve: num_attention_heads (4) is not divisible by tensor_parallel_size "
        "(3); choose a tensor_parallel_size that divides it"
    ]
