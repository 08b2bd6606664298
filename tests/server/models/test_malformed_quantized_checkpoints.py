"""Malformed quantized checkpoints are refused at load in one line naming
the tensor or config field (``paged-server serve``: exit 2, no traceback),
never served as garbage or as 500s: missing tensors, zero or wrong scale
counts, NaN scales, configs of the wrong type or a format we do not read,
and a quantization_config over dense weights.

Each case edits a copy of a valid tiny GPTQ, AWQ or compressed-tensors
checkpoint (written as test_quantized_checkpoints.py writes them)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.server.models.test_quantized_checkpoints import (
    _hf_model,
    _save,
    _write_compressed_tensors,
    _write_int4_layout,
)

from paged_server.entrypoints.cli import main
from paged_server.models import load_model
from paged_server.models.errors import ModelLoadError

LAYER = "model.layers.0.self_attn.q_proj"
Edit = Callable[[dict[str, torch.Tensor], dict[str, Any]], None]


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory, tokenizer_json: Path) -> dict[str, Path]:
    """One valid checkpoint per format, and dense weights."""
    root = tmp_path_factory.mktemp("valid-quantized")
    dense = _save(_hf_model(), root / "dense", tokenizer_json)
    return {
        "gptq": _write_int4_layout("gptq", root / "gptq", tokenizer_json)[0],
        "awq": _write_int4_layout("awq", root / "awq", tokenizer_json)[0],
        "ct": _write_compressed_tensors(root / "ct", "W4A16", tokenizer_json)[0],
        "dense": dense,
    }


def _drop(key: str) -> Edit:
    def edit(state: dict[str, torch.Tensor], qc: dict[str, Any]) -> None:
        del state[key]

    return edit


def _set(field: str, value: Any) -> Edit:
    return lambda state, qc: qc.update({field: value})


def _scales(fn: Callable[[torch.Tensor], torch.Tensor], *keys: str) -> Edit:
    def edit(state: dict[str, torch.Tensor], qc: dict[str, Any]) -> None:
        for key in keys:
            state[key] = fn(state[key]).contiguous()

    return edit


def _nan(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


CASES: dict[str, tuple[str, Edit, str]] = {
    # name: (checkpoint, edit, what the one line names)
    "gptq missing scales": ("gptq", _drop(f"{LAYER}.scales"), f"{LAYER}.scales is missing"),
    "gptq missing qzeros": ("gptq", _drop(f"{LAYER}.qzeros"), f"{LAYER}.qzeros is missing"),
    "gptq zero groups": (
        "gptq", _scales(lambda t: t[:0], f"{LAYER}.scales", f"{LAYER}.qzeros"), "0 groups",
    ),
    "gptq wrong scale count": (
        "gptq", _scales(lambda t: t.repeat(3, 1), f"{LAYER}.scales", f"{LAYER}.qzeros"),
        f"{LAYER}.scales has 3 groups",
    ),
    "gptq scale columns": (
        "gptq", _scales(lambda t: t[:, :-8], f"{LAYER}.scales"), f"{LAYER}.scales",
    ),
    "gptq NaN scales": ("gptq", _scales(_nan, f"{LAYER}.scales"), f"{LAYER}.scales holds NaN"),
    "gptq bits a string": ("gptq", _set("bits", "4"), "bits must be a number (4 or 8), got '4'"),
    "gptq 8 bits over 4-bit tensors": ("gptq", _set("bits", 8), "bits 8"),
    "gptq marlin format": ("gptq", _set("checkpoint_format", "marlin"), "checkpoint_format"),
    "gptq config over dense weights": ("dense", _set("quant_method", "gptq"), "no quantized"),
    "awq missing scales": ("awq", _drop(f"{LAYER}.scales"), f"{LAYER}.scales is missing"),
    "awq missing qzeros": ("awq", _drop(f"{LAYER}.qzeros"), f"{LAYER}.qzeros is missing"),
    "awq zero groups": (
        "awq", _scales(lambda t: t[:0], f"{LAYER}.scales", f"{LAYER}.qzeros"), "0 groups",
    ),
    "awq bits a string": ("awq", _set("bits", "4"), "bits must be a number"),
    "ct missing weight_scale": (
        "ct", _drop(f"{LAYER}.weight_scale"), f"{LAYER}.weight_scale is missing",
    ),
    "ct missing weight_shape": (
        "ct", _drop(f"{LAYER}.weight_shape"), f"{LAYER}.weight_shape is missing",
    ),
    "ct 3-dim weight_shape": (
        "ct", _scales(lambda t: torch.cat([t, t[:1]]), f"{LAYER}.weight_shape"),
        f"{LAYER}.weight_shape",
    ),
    "ct wrong scale count": (
        "ct", _scales(lambda t: t[:, :1].repeat(1, 3), f"{LAYER}.weight_scale"),
        f"{LAYER}.weight_scale has 3 groups",
    ),
    "ct zero groups": ("ct", _scales(lambda t: t[:, :0], f"{LAYER}.weight_scale"), "0 groups"),
    "ct NaN scales": (
        "ct", _scales(_nan, f"{LAYER}.weight_scale"), f"{LAYER}.weight_scale holds NaN",
    ),
    "ct config_groups a list": ("ct", _set("config_groups", ["group_0"]), "config_groups"),
    "config a string": ("gptq", lambda state, qc: qc.clear(), "quantization_config must be"),
}  # fmt: skip


def _malformed(valid: dict[str, Path], case: str, into: Path) -> Path:
    source, edit, _ = CASES[case]
    shutil.copytree(valid[source], into)
    state = load_file(str(into / "model.safetensors"))
    config = json.loads((into / "config.json").read_text())
    qc = config.setdefault("quantization_config", {})
    edit(state, qc)
    if case == "config a string":
        config["quantization_config"] = "gptq"
    save_file(state, str(into / "model.safetensors"))
    (into / "config.json").write_text(json.dumps(config))
    return into


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_quantized_checkpoints_are_refused_in_one_line(
    case: str, valid: dict[str, Path], tmp_path: Path
) -> None:
    path = _malformed(valid, case, tmp_path / "model")
    with pytest.raises(ModelLoadError) as err:
        load_model(path, torch.float32)
    message = str(err.value)
    assert CASES[case][2] in message, message
    assert "\n" not in message and "act-order" not in message


def test_serve_refuses_a_malformed_checkpoint_with_exit_2(
    valid: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _malformed(valid, "gptq missing scales", tmp_path / "model")
    status = main(["serve", "--model", str(path), "--port", "0"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"{LAYER}.scales is missing" in lines[0], err
