"""EngineConfig and SamplingParams validation: each bad field is named in the error."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from paged_server.config import EngineConfig
from paged_server.models.config import ModelConfig
from paged_server.output_constraint import StructuredOutputsParams
from paged_server.platform import cpu_has_bf16
from paged_server.sampling_params import SamplingParams

# A model with 4096 positions and no sliding window: all `resolve` reads of it.
MODEL = ModelConfig.from_hf(
    {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
     "max_position_embeddings": 4096, "rms_norm_eps": 1e-6},
    "LlamaForCausalLM",
)  # fmt: skip
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_defaults_are_valid() -> None:
    EngineConfig().validate()
    SamplingParams().validate(max_model_len=2048)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"kv_cache_backend": "blocks"}, "kv_cache_backend"),
        ({"attention_backend": "cuda"}, "attention_backend"),
        ({"dtype": "fp8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"block_size": 0}, "block_size"),
        ({"num_gpu_blocks": 0}, "num_gpu_blocks"),
        ({"kv_cache_memory_bytes": -1}, "kv_cache_memory_bytes"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"max_queue_len": 0}, "max_queue_len"),
        ({"block_size": 2.5}, "block_size"),
        ({"max_batch_size": True}, "max_batch_size"),
        ({"seed": "x"}, "seed"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"long_prefill_token_threshold": 1.5}, "long_prefill_token_threshold"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ],
)
def test_engine_config_rejects_bad_field(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}"):
        EngineConfig(**overrides).validate()


def test_batched_tokens_must_cover_the_batch_and_unchunked_prompts() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        EngineConfig(max_batch_size=64, max_num_batched_tokens=32).validate()
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        EngineConfig(
            max_model_len=2048, max_num_batched_tokens=512, enable_chunked_prefill=False
        ).validate()
    EngineConfig(max_model_len=2048, max_num_batched_tokens=512).validate()  # chunked: fine


def test_auto_resolution_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGED_CPU_BF16", "0")
    run = EngineConfig(device="cpu").resolve(MODEL)
    assert run.torch_device.type == "cpu"
    assert run.torch_dtype is torch.float32 and run.dtype_reason == "auto: CPU has no AMX/AVX512-BF16"
    assert run.attention_backend == "ref"
    assert (run.max_model_len, run.max_num_batched_tokens) == (4096, 256)
    explicit = EngineConfig(dtype="float16", device="cpu").resolve(MODEL)
    assert explicit.torch_dtype is torch.float16 and explicit.dtype_reason == ""


def test_the_config_as_run_is_frozen_and_still_an_engine_config() -> None:
    run = EngineConfig(device="cpu").resolve(MODEL)
    with pytest.raises(AttributeError):
        run.max_model_len = 8  # type: ignore[misc]
    assert isinstance(run, EngineConfig) and "max_num_batched_tokens=256" in run.summary()


def _dtype(monkeypatch: pytest.MonkeyPatch, bf16: str, config: EngineConfig, device=CPU) -> torch.dtype:
    monkeypatch.setenv("PAGED_CPU_BF16", bf16)
    return config.resolve(MODEL, device).torch_dtype


def test_auto_dtype_is_bf16_on_a_cpu_with_bf16_units(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _dtype(monkeypatch, "1", EngineConfig()) is torch.bfloat16
    assert _dtype(monkeypatch, "1", EngineConfig(dtype="float32")) is torch.float32
    assert _dtype(monkeypatch, "0", EngineConfig(), CUDA) is torch.bfloat16
    # Detection: AMX tiles or AVX512-BF16, as torch reports them.
    monkeypatch.delenv("PAGED_CPU_BF16", raising=False)
    for amx, avx512_bf16, expected in [(True, False, True), (False, True, True), (False, False, False)]:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda b=avx512_bf16: b)
        assert cpu_has_bf16() is expected
        dtype = EngineConfig().resolve(MODEL, CPU).torch_dtype
        assert dtype is (torch.bfloat16 if expected else torch.float32)
    monkeypatch.setenv("PAGED_CPU_BF16", "0")  # the suite's setting: auto is float32 everywhere
    assert cpu_has_bf16() is False


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    triton = EngineConfig(attention_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton.resolve(MODEL, CPU).attention_backend == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA device; on CPU set TRITON_INTERPRET=1"):
        triton.resolve(MODEL, CPU)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_gpu_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no CUDA GPU"):
        EngineConfig(device="cuda").resolve(MODEL)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"seed": 1.5}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**63}, "top_k"),  # overflowed the sampler's int64 tensor
        # the grammar ends the output when complete: min_tokens would be ignored
        ({"min_tokens": 5, "structured_outputs": StructuredOutputsParams(json_object=True)}, "min_tokens"),
    ],
)
def test_sampling_params_reject_bad_field(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: "):
        SamplingParams(**overrides).validate(max_model_len=4096)


def test_single_stop_string_becomes_a_list() -> None:
    assert SamplingParams(stop="\n").stop == ["\n"]


def test_step_token_budget_fits_the_device() -> None:
    def budget(device: torch.device, **config: Any) -> int:
        return EngineConfig(**config).resolve(MODEL, device).max_num_batched_tokens

    assert budget(CPU) == 256
    assert budget(CUDA) == 2048
    # never below what every running sequence needs to decode in one step
    assert budget(CPU, max_batch_size=300) == 300
    # whole prompts only: the budget must hold the longest one (the model's 4096 when unset)
    assert budget(CPU, enable_chunked_prefill=False, max_model_len=4096) == 4096
    assert budget(CPU, enable_chunked_prefill=False) == 4096
    assert budget(CPU, max_num_batched_tokens=999) == 999


def test_engine_records_the_budget_it_runs_with(make_engine) -> None:
    engine = make_engine(max_num_batched_tokens=None)
    assert engine.config.max_num_batched_tokens == 256
    assert engine.scheduler.max_num_batched_tokens == 256
