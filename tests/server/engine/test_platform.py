"""platform.py: each device type's answers, and the call sites that ask them."""

from __future__ import annotations

import pytest
import torch

from paged_server import platform as platform_module
from paged_server.config import EngineConfig
from paged_server.engine.kv.kv_sizing import sizes_by_memory_share
from paged_server.engine.worker.compiled_forward import compiles_forward
from paged_server.models.config import ModelConfig
from paged_server.models.llama import LlamaForCausalLM
from paged_server.platform import (
    CpuPlatform,
    CudaPlatform,
    platform_for,
    resolve_device,
    usable_cpu_cores,
)

MODEL = ModelConfig.from_hf(
    {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
     "max_position_embeddings": 4096, "rms_norm_eps": 1e-6},
    "LlamaForCausalLM",
)  # fmt: skip


def test_platform_for_names_the_device_type() -> None:
    assert isinstance(platform_for("cpu"), CpuPlatform)
    assert isinstance(platform_for(torch.device("cuda", 1)), CudaPlatform)
    assert platform_for("cuda:3") is platform_for("cuda")  # one object per device type
    with pytest.raises(ValueError, match="'meta' is not supported"):
        platform_for("meta")


def test_cpu_platform_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, device = platform_for("cpu"), torch.device("cpu")
    assert (cpu.supports_cuda_graphs, cpu.compiles_forward, cpu.warms_up_kernels) == (False, True, False)
    assert not cpu.async_scheduling_by_default and cpu.default_batched_tokens == 256
    assert not cpu.sizes_kv_by_memory_share and not cpu.kv_in_device_memory and cpu.ranks_share_host
    monkeypatch.setenv("PAGED_CPU_BF16", "1")
    assert cpu.default_dtype("float16") is torch.bfloat16 and cpu.dtype_reason(torch.bfloat16).endswith(" has AMX/AVX512-BF16")
    monkeypatch.setenv("PAGED_CPU_BF16", "0")
    assert cpu.default_dtype("bfloat16") is torch.float32 and "has no" in cpu.dtype_reason(torch.float32)
    assert cpu.rank_device(device, 3) == device and cpu.unavailable_reason() is None
    cpu.set_device(device)  # nothing to do, nothing raised
    cpu.synchronize(device)
    cpu.check_ranks(usable_cpu_cores(), device)
    cpu.check_ranks(usable_cpu_cores() + 1, device, busy=1)  # stages time-slice the cores
    with pytest.raises(ValueError, match="needs a CPU core per rank"):
        cpu.check_ranks(usable_cpu_cores() + 1, device)


def test_cuda_platform_answers_without_touching_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_gpu(*args: object, **kwargs: object) -> None:
        raise AssertionError("touched the GPU")

    for name in ("is_available", "device_count", "set_device", "synchronize", "current_device", "init"):
        monkeypatch.setattr(torch.cuda, name, no_gpu)
    cuda = CudaPlatform()
    assert (cuda.supports_cuda_graphs, cuda.compiles_forward, cuda.warms_up_kernels) == (True, False, True)
    assert cuda.async_scheduling_by_default and cuda.default_batched_tokens == 2048
    assert cuda.sizes_kv_by_memory_share and cuda.kv_in_device_memory and not cuda.ranks_share_host
    # as vLLM: float16 stays, float32 or unnamed runs in bfloat16
    assert cuda.default_dtype("float16") is torch.float16
    assert cuda.default_dtype("float32") is cuda.default_dtype(None) is torch.bfloat16
    assert cuda.dtype_reason(torch.bfloat16) == "auto: CUDA"
    assert cuda.rank_device(torch.device("cuda", 1), 2) == torch.device("cuda", 3)
    assert cuda.rank_device(torch.device("cuda"), 1) == torch.device("cuda", 1)


def test_cuda_without_a_gpu_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA GPU is available; use 'cpu' or 'auto'"):
        resolve_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    CudaPlatform().check_ranks(2, torch.device("cuda"))
    with pytest.raises(ValueError, match="needs 2 GPUs from cuda:1 on but 2 are visible"):
        CudaPlatform().check_ranks(2, torch.device("cuda", 1))


def test_call_sites_ask_the_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU platform with other answers changes what config, sizing and the
    compiled pass decide: none of them compares device types itself."""

    class Other(CpuPlatform):
        default_batched_tokens = 96
        async_scheduling_by_default = True
        sizes_kv_by_memory_share = True
        compiles_forward = False

        def default_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
            return torch.float16

        def dtype_reason(self, dtype: torch.dtype) -> str:
            return "auto: other"

    cpu, config = torch.device("cpu"), EngineConfig(device="cpu")
    monkeypatch.setenv("PAGED_COMPILE", "1")
    assert compiles_forward(LlamaForCausalLM, config, cpu, "ref")
    assert not sizes_by_memory_share(config, cpu)
    monkeypatch.setitem(platform_module.PLATFORMS, "cpu", Other())
    run = config.resolve(MODEL)
    assert (run.max_num_batched_tokens, run.torch_dtype, run.dtype_reason) == (96, torch.float16, "auto: other")
    assert run.async_scheduling is True
    assert not compiles_forward(LlamaForCausalLM, config, cpu, "ref")
    assert sizes_by_memory_share(config, cpu)
