"""The model's own settings as defaults, as vLLM: max_model_len from
max_position_embeddings, dtype auto from the checkpoint, sampling defaults
from generation_config.json."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from paged_server.config import EngineConfig
from paged_server.engine.core.llm_engine import LLMEngine
from paged_server.engine.kv.kv_sizing import CPU_DEFAULT_KV_BYTES, kv_budget
from paged_server.entrypoints.llm import LLM
from paged_server.generation_defaults import generation_defaults
from paged_server.models import LoadedModel
from paged_server.models.loader import checkpoint_dtype, read_model_config

CPU = torch.device("cpu")
SMALL = dict(max_batch_size=4, max_num_batched_tokens=64, device="cpu", attention_backend="ref")


def _copy(src: Path, dst: Path, **config_edits: Any) -> Path:
    shutil.copytree(src, dst)
    if config_edits:
        config = json.loads((dst / "config.json").read_text())
        config.update(config_edits)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_max_model_len_defaults_to_the_models_positions(tiny_loaded: LoadedModel) -> None:
    assert LLMEngine(EngineConfig(**SMALL), tiny_loaded).config.max_model_len == 512
    assert LLMEngine(EngineConfig(max_model_len=64, **SMALL), tiny_loaded).config.max_model_len == 64


def test_disable_sliding_window_caps_the_context_at_the_window(tiny_hybrid_loaded: LoadedModel) -> None:
    engine = LLMEngine(EngineConfig(disable_sliding_window=True, **SMALL), tiny_hybrid_loaded)
    assert engine.config.max_model_len == 8  # the window, not 512 positions
    assert engine.config.disable_hybrid_kv_cache_manager and engine.capacity.num_groups == 1
    with pytest.raises(ValueError, match="more than the model's sliding window 8"):
        LLMEngine(EngineConfig(disable_sliding_window=True, max_model_len=16, **SMALL), tiny_hybrid_loaded)


def test_cpu_default_pool_is_capped_for_long_model_contexts() -> None:
    config = EngineConfig(max_batch_size=64, max_model_len=40960)
    budget = kv_budget(config, 56 * 1024, CPU, None)  # Qwen3-4B's bf16 bytes per token
    assert budget.num_bytes == CPU_DEFAULT_KV_BYTES and "CPU default cap of 4 GiB" in budget.sized_by
    qwen3_8b = kv_budget(config, 144 * 1024, CPU, None)  # 40960 tokens take 5.6 GiB: one sequence
    assert qwen3_8b.num_bytes == 40960 * 144 * 1024
    small = kv_budget(EngineConfig(max_batch_size=4, max_model_len=512), 4096, CPU, None)
    assert small.num_bytes is None  # the old default: max_batch_size x max_model_len
    with pytest.raises(ValueError, match="one sequence of 10000000000 tokens needs 9536.7 GiB"):
        kv_budget(EngineConfig(max_model_len=10**10), 1024, CPU, None)


def test_dtype_auto_follows_the_checkpoint(tiny_model_dir: Path, tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    assert checkpoint_dtype(str(tiny_model_dir)) == "float32"
    bf16_dir = _copy(tiny_model_dir, tmp_path / "bf16", dtype=None, torch_dtype="bfloat16")
    assert checkpoint_dtype(str(bf16_dir)) == "bfloat16"
    model = read_model_config(tiny_model_dir)

    def dtype(device: torch.device, checkpoint: str, config: EngineConfig = EngineConfig()) -> torch.dtype:
        return config.resolve(model, device, checkpoint_dtype=checkpoint).torch_dtype

    cuda = torch.device("cuda")
    assert dtype(cuda, "float16") is torch.float16
    assert dtype(cuda, "bfloat16") is torch.bfloat16
    assert dtype(cuda, "float32") is torch.bfloat16  # as vLLM
    monkeypatch.setenv("PAGED_CPU_BF16", "1")
    assert dtype(CPU, "bfloat16") is torch.bfloat16
    monkeypatch.setenv("PAGED_CPU_BF16", "0")
    with caplog.at_level(logging.INFO, logger="paged_server.platform"):  # the CPU's answer, logged there
        assert dtype(CPU, "bfloat16") is torch.float32
    assert "checkpoint is bfloat16 but this CPU has no bf16" in caplog.text
    assert dtype(CPU, "bfloat16", EngineConfig(dtype="float16")) is torch.float16


def test_generation_config_sampling_defaults(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = _copy(tiny_model_dir, tmp_path / "m")
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "top_k": 5, "top_p": 0.9, "max_new_tokens": 7, "do_sample": True}
    ))
    expected = {"temperature": 0.0, "top_k": 5, "top_p": 0.9, "max_tokens": 7}
    assert generation_defaults(str(model), "auto") == expected
    assert generation_defaults(str(model), "vllm") == {}
    assert generation_defaults(str(model), "vllm", {"temperature": 0.5}) == {"temperature": 0.5}
    assert generation_defaults(None, str(model), {"max_new_tokens": 3})["max_tokens"] == 3
    with pytest.raises(ValueError, match="unknown key 'beams'"):
        generation_defaults(str(model), "auto", {"beams": 2})
    with pytest.raises(ValueError, match="holds no generation_config.json"):
        generation_defaults(None, str(tmp_path))
    llm = LLM(str(model), **SMALL, max_model_len=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 5, 7)
    first, again = llm.generate(["hello", "hello"], use_tqdm=False)  # no params: the model's
    assert first.outputs[0].token_ids == again.outputs[0].token_ids  # temperature 0: greedy
    assert 1 <= len(first.outputs[0].token_ids) <= 7
    plain = LLM(str(model), **SMALL, max_model_len=64, generation_config="vllm")
    assert plain.get_default_sampling_params().temperature == 1.0
