"""platform.py: each device type's answers, and the call sites that ask them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from paged_server import platform as platform_module
from paged_server.config import EngineConfig
from paged_server.data_parallel.engine import replica_devices
from paged_server.engine.kv.kv_sizing import GIB, kv_budget, sizes_by_memory_share
from paged_server.engine.worker.compiled_forward import compiles_forward
from paged_server.entrypoints.openai.async_engine import HANDOFF_WAIT_S, AsyncEngine
from paged_server.models.config import ModelConfig
from paged_server.models.llama import LlamaForCausalLM
from paged_server.platform import (
    CpuPlatform,
    CudaPlatform,
    MemoryProfile,
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
    assert cpu.waits_for_event_loop
    monkeypatch.setenv("PAGED_CPU_BF16", "1")
    assert cpu.default_dtype("float16") is torch.bfloat16 and cpu.dtype_reason(torch.bfloat16).endswith(" has AMX/AVX512-BF16")
    monkeypatch.setenv("PAGED_CPU_BF16", "0")
    assert cpu.default_dtype("bfloat16") is torch.float32 and "has no" in cpu.dtype_reason(torch.float32)
    assert cpu.rank_device(device, 3) == device and cpu.unavailable_reason() is None
    cpu.set_device(device)  # nothing to do, nothing raised
    cpu.synchronize(device)
    cpu.check_ranks(usable_cpu_cores(), device)
    cpu.check_ranks(usable_cpu_cores() + 1, device, busy=1)  # stages time-slice the cores
    cpu.check_replicas(usable_cpu_cores() + 1, 4, device)  # replicas share the cores
    with pytest.raises(NotImplementedError, match="not sized from device memory"):
        cpu.profile_memory(device, lambda: None)
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
    assert not cuda.waits_for_event_loop
    # as vLLM: float16 stays, float32 or unnamed runs in bfloat16
    assert cuda.default_dtype("float16") is torch.float16
    assert cuda.default_dtype("float32") is cuda.default_dtype(None) is torch.bfloat16
    assert cuda.dtype_reason(torch.bfloat16) == "auto: CUDA"
    assert cuda.rank_device(torch.device("cuda", 1), 2) == torch.device("cuda", 3)
    assert cuda.rank_device(torch.device("cuda"), 1) == torch.device("cuda", 1)


def test_cuda_set_device_passes_only_an_indexed_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda.set_device refuses a bare "cuda" (ValueError: no index): the
    executor thread's initializer hit it, and every step of an engine on
    "cuda" failed (first seen on an H200). A bare "cuda" is the thread's
    current device: nothing to set."""
    calls: list[torch.device] = []

    def set_device(device: torch.device) -> None:
        if device.index is None:
            raise ValueError(f"Expected a torch.device with a specified index, but got:{device}")
        calls.append(device)

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    CudaPlatform().set_device(torch.device("cuda"))
    CudaPlatform().set_device(torch.device("cuda", 1))
    assert calls == [torch.device("cuda", 1)]


def test_cuda_without_a_gpu_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA GPU is available; use 'cpu' or 'auto'"):
        resolve_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    CudaPlatform().check_ranks(2, torch.device("cuda"))
    with pytest.raises(ValueError, match="needs 2 GPUs from cuda:1 on but 2 are visible"):
        CudaPlatform().check_ranks(2, torch.device("cuda", 1))
    CudaPlatform().check_replicas(2, 1, torch.device("cuda"))
    with pytest.raises(ValueError, match=r"2 replicas of 1 GPU\(s\) from cuda:1 need 3 GPUs, this machine has 2"):
        CudaPlatform().check_replicas(2, 1, torch.device("cuda", 1))


def test_cuda_profile_measures_the_pass_between_allocator_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass runs after the peak is reset and before it is read; the
    driver's free memory is read last, after the cache is emptied."""
    calls: list[str] = []
    allocated = {"now": 100, "peak": 100}

    def run() -> None:
        calls.append("run")
        allocated["peak"] = allocated["now"] + 40

    def reset(device: torch.device) -> None:
        calls.append("reset")
        allocated["peak"] = allocated["now"]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: allocated["peak"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (calls.append("info"), (700, 1000))[1])
    memory = CudaPlatform().profile_memory(torch.device("cuda", 0), run)
    assert memory == MemoryProfile(total=1000, used=300, peak=40)
    assert calls == ["sync", "empty", "reset", "run", "sync", "empty", "info"]


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


def test_process_decisions_ask_the_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """The event-loop hand-off, the KV budget's memory reading and the
    replicas' devices come from the platform, not from the device's name."""
    profiled: list[int] = []

    class Other(CpuPlatform):
        waits_for_event_loop = False
        sizes_kv_by_memory_share = True
        kv_in_device_memory = True

        def profile_memory(self, device: torch.device, run: object) -> MemoryProfile:
            profiled.append(1)
            return MemoryProfile(total=10 * GIB, used=2 * GIB, peak=GIB)

        def rank_device(self, device: torch.device, rank: int) -> torch.device:
            return torch.device("meta", rank)

    cpu, config = torch.device("cpu"), EngineConfig(device="cpu", block_size=16)
    engine = SimpleNamespace(config=SimpleNamespace(device="cpu"))
    assert AsyncEngine(engine).handoff_wait_s == HANDOFF_WAIT_S
    assert replica_devices("cpu", 2, 2) == ["cpu", "cpu"]
    monkeypatch.setitem(platform_module.PLATFORMS, "cpu", Other())
    assert AsyncEngine(engine).handoff_wait_s == 0.0
    budget = kv_budget(config, 1024, cpu, None)
    assert budget.num_bytes == int(10 * GIB * 0.9) - 3 * GIB and profiled == [1]
    assert "of 10.0 GiB: 2.00 GiB in use" in budget.sized_by
    assert replica_devices("cpu", 2, 2) == ["meta:0", "meta:2"]


def test_auto_resolves_as_config_does_and_replicas_count_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = SimpleNamespace(config=SimpleNamespace(device="auto"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert replica_devices("auto", 2, 2) == ["cpu", "cpu"]
    assert AsyncEngine(engine).handoff_wait_s == HANDOFF_WAIT_S
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert AsyncEngine(engine).handoff_wait_s == 0.0
    assert replica_devices("auto", 2, 2) == ["cuda:0", "cuda:2"]
    assert replica_devices("cuda:1", 3) == ["cuda:1", "cuda:2", "cuda:3"]
    with pytest.raises(ValueError, match="2 replicas of 2 GPU\\(s\\) from cuda:1 need 5 GPUs, this machine has 4"):
        replica_devices("cuda:1", 2, 2)
