"""`paged-server serve` refuses bad flags and unusable addresses in one line
(exit status 2, no traceback), and checks the address before it loads the
model: a user learns of a busy port in a second, not after minutes of loading."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

from paged_server.config import EngineConfig
from paged_server.default_model import ensure_default_model
from paged_server.engine.core.llm_engine import LLMEngine
from paged_server.entrypoints.cli import main

pytestmark = pytest.mark.e2e

ALLOW_LONG_MAX_MODEL_LEN_ENV = "PAGED_ALLOW_LONG_MAX_MODEL_LEN"  # as docs/serving.md names it


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ``serve`` with ``argv``; its one-line complaint (exit status 2)."""
    try:
        status = main(["serve", *argv])
    except SystemExit as exc:  # argparse's own refusals
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if not line.startswith(("usage:", " "))]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--audit-interval", "-1"], "--audit-interval: must be >= 0"),
        (["--max-body-bytes", "0"], "--max-body-bytes: must be >= 1"),
        (["--max-body-bytes", "-1"], "--max-body-bytes: must be >= 1"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout: must be >= 0"),
        (["--shutdown-timeout", "nan"], "--shutdown-timeout: must be >= 0"),
        (["--port", "70000"], "--port: must be in 0..65535"),
        (["--port", "-1"], "--port: must be in 0..65535"),
    ],
)
def test_bad_server_flags_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                       fragment: str) -> None:
    assert fragment in _refused(capsys, *argv)


def test_a_busy_port_is_reported_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        # The model directory does not exist: had it been loaded first, that would be the error.
        line = _refused(capsys, "--port", str(port), "--model", str(tmp_path / "absent"))
    assert f"127.0.0.1:{port} is already in use" in line


def test_an_unresolvable_host_is_reported_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _refused(capsys, "--host", "no-such-host.invalid", "--port", "0",
                    "--model", str(tmp_path / "absent"))
    assert "--host no-such-host.invalid" in line


def test_max_model_len_beyond_the_model_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for value in ("4096", str(10**12)):
        line = _refused(capsys, "--max-model-len", value, "--port", "0")
        assert f"max_model_len: {value} is more than the model's max_position_embeddings 2048" in line
        assert f"{ALLOW_LONG_MAX_MODEL_LEN_ENV}=1" in line


def test_the_long_max_model_len_override_runs_past_the_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, "1")
    engine = LLMEngine(EngineConfig(max_model_len=4096, max_batch_size=2, device="cpu",
                                    attention_backend="ref", num_gpu_blocks=16))
    assert engine.config.max_model_len == 4096
    # Overridden, a length no memory can hold is still one line.
    line = _refused(capsys, "--max-model-len", str(10**12), "--port", "0")
    assert "KV cache" in line and "memory" in line


def test_a_draft_model_with_another_tokenizer_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from paged_server.default_model.tokenizer_builder import build_tokenizer

    draft = tmp_path / "draft"
    draft.mkdir()
    build_tokenizer(256).save(str(draft / "tokenizer.json"))
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=2048)).save_pretrained(draft)  # fmt: skip
    capsys.readouterr()  # transformers' progress bar
    spec = f'{{"model": "{draft}", "num_speculative_tokens": 2}}'
    line = _refused(capsys, "--speculative-config", spec, "--max-model-len", "256", "--port", "0")
    assert f"draft model {draft} does not share the tokenizer" in line and "vocab_size 256 against" in line
    missing = _refused(capsys, "--speculative-config", '{"model": "/no/such/draft", "num_speculative_tokens": 2}',
                       "--max-model-len", "256", "--port", "0")  # fmt: skip
    assert missing.startswith("paged-server serve: speculative_config: draft model /no/such/draft: ")


def test_a_truncated_checkpoint_names_the_file(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    shutil.copytree(ensure_default_model(), model)
    weights = model / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    line = _refused(capsys, "--model", str(model), "--port", "0")
    assert f"{weights} is not a readable safetensors file" in line and "truncated" in line




@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--lora-modules", "sql"], "expected name=path or a JSON object"),
        (["--lora-modules", '{"name": "sql"}'], 'needs "name" and "path"'),
        (["--lora-modules", "sql=/no/such/adapter"], "needs --enable-lora too"),
        (["--enable-lora", "--lora-modules", "sql=/no/such/adapter"], "no adapter_config.json"),
        (["--enable-lora", "-q", "int8"], "adapters on quantized weights"),
        (["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"], "max_cpu_loras (1) must be >= max_loras (2)"),
    ],
)
def test_lora_flags_are_refused_in_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                            fragment: str) -> None:
    assert fragment in _refused(capsys, *argv, "--port", "0")
