"""An outside client in CI: guidellm (vLLM's benchmark client) runs its own
benchmark against a real server on loopback, streaming with the usage
options it always sends (``stream_options: {include_usage,
continuous_usage_stats}``), on both endpoints; every request must succeed
and be counted from the server's usage. Skipped where guidellm is not
installed (it is a test dependency in noxfile.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tests.e2e.conftest import MODEL

from paged_server.default_model import ensure_default_model

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("guidellm") is None, reason="guidellm is not installed"),
]

REQUESTS = 6
PROMPT_TOKENS, OUTPUT_TOKENS = 16, 8


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_benchmark_succeeds_on_every_request(server: Any, tmp_path: Path, endpoint: str) -> None:
    report = tmp_path / "report.json"
    cmd = [
        sys.executable, "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={server.url},model={MODEL},request_format={endpoint}",
        "--profile", "kind=concurrent,streams=2",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=hf_auto,model={ensure_default_model()}",
        "--output", f"kind=json,path={report}",
        "--disable-console",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    requests = json.loads(report.read_text())["benchmarks"][0]["requests"]
    errors = [r.get("info") for r in requests["errored"] + requests["incomplete"]]
    assert not errors, errors
    assert len(requests["successful"]) == REQUESTS
    for request in requests["successful"]:
        body = json.loads(request["request_args"])["body"]
        assert body["stream"] and body["stream_options"] == {"include_usage": True,
                                                             "continuous_usage_stats": True}
        assert request["output_tokens"] == OUTPUT_TOKENS  # ignore_eos: all of them, from our usage
        assert request["prompt_tokens"] > 0 and request["output"]
