"""The quantized decode benchmark runs end to end and says how each engine
ran (the test suite's engines run eager, float32 activations for ``auto``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantized_decode import main


def test_rows_state_forward_mode_and_activations(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["--model", str(tiny_model_dir), "--formats", "bfloat16,int8", "--concurrency", "1",
          "--tokens", "3", "--rounds", "1"])  # fmt: skip
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"format"')]
    assert [(r["format"], r["forward"], r["activations"]) for r in rows] == [
        ("bfloat16", "eager", "bfloat16"),
        ("int8", "eager", "float32"),
    ]
    assert rows[0]["cpu_vs_bfloat16"] == 1.0 and rows[1]["cpu_tok_s"] > 0
    assert "forward" in out.split("\n\n")[-1]  # the table's header
