"""`paged-server serve` as a user runs it (subprocess, signals) and
`paged-server bench-serve` end to end."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest

from paged_server.entrypoints.cli import main

pytestmark = pytest.mark.e2e

STARTUP = re.compile(
    r"serving '(?P<model>[^']+)' \(embedded default model\) on (?P<url>http://127\.0\.0\.1:\d+) \| "
    r"dtype=float32 \(auto: CPU has no AMX/AVX512-BF16\) "  # the suite sets PAGED_CPU_BF16=0
    r"kv_cache_backend=paged attention=ref \| KV cache float32 \(kv_cache_dtype=auto\): "
    r"capacity (?P<tokens>\d+) tokens in (?P<blocks>\d+) blocks of 16"
)


def test_serve_logs_startup_and_shuts_down_cleanly_on_sigterm(tmp_path: Any) -> None:
    cmd = [sys.executable, "-m", "paged_server.entrypoints.cli", "serve", "--port", "0", "--max-model-len", "2048",
           "--device", "cpu", "--attention-backend", "ref", "--num-gpu-blocks", "512",
           "--shutdown-timeout", "1", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        m = STARTUP.search(line)
        assert m, f"unexpected start-up line: {line!r}"
        assert int(m["tokens"]) == 512 * 16 and int(m["blocks"]) == 512
        url = m["url"]
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server never became healthy"
            time.sleep(0.1)

        seen: dict[str, Any] = {"events": 0, "done": False, "closed": False}

        def stream() -> None:  # a long generation still running at shutdown
            body = {"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: "):
                            seen["events"] += 1
                            seen["done"] = seen["done"] or line == "data: [DONE]"
            except httpx.HTTPError:
                pass
            seen["closed"] = True

        reader = threading.Thread(target=stream)
        reader.start()
        while seen["events"] < 3:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        reader.join(timeout=10)
        # uvicorn shuts down gracefully, then re-raises the signal so the exit
        # status still says "terminated by SIGTERM".
        assert rc in (0, -signal.SIGTERM)
        rest = proc.stderr.read()
        assert "in-flight request(s) aborted at shutdown" in rest, rest
        assert seen["closed"] and not reader.is_alive()
        assert seen["events"] < 2000  # cut short, not run to the end
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bench_serve_reports_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    engine_threads = {t for t in threading.enumerate() if t.name == "paged-engine"}
    rc = main(["bench-serve", "--workload", "continuous_batching", "--num-requests", "8",
               "--request-rate", "20", "--prompt-scale", "0.1", "--new-tokens-scale", "0.1",
               "--max-model-len", "256", "--device", "cpu", "--attention-backend", "ref"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and len(out) == 1
    report = json.loads(out[0])
    assert report["completed"] == 8 and report["failed"] == 0
    assert report["request_rate"] == 20
    # EOS ignored: exactly the tokens the workload asked for
    assert report["output_tokens"] == report["workload"]["max_tokens"]["total"]
    for key in ("ttft_ms", "itl_ms"):
        p = report[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"]
    assert report["output_tokens_per_s"] > 0
    assert report["server"]["prefix_cache_queries_total"] > 0
    # The engine config as run: the CPU default step budget is filled in.
    assert report["engine_config"]["max_num_batched_tokens"] == 256
    assert set(report["running"]) == {"mean", "peak", "samples"}
    # Its engine thread ended with the run: a later run in this process must not
    # step beside an idle OpenMP pool.
    assert {t for t in threading.enumerate() if t.name == "paged-engine"} <= engine_threads


def test_bench_hook_runs_the_offline_benchmark_cli(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    assert "usage: paged-server bench" in capsys.readouterr().out


def test_serve_reports_a_missing_model_directory_without_a_traceback(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-model"
    assert main(["serve", "--model", str(missing), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"model directory {missing} does not exist" in err
    assert "Traceback" not in err
