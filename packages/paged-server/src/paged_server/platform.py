"""What the process does on its device type, decided in one place.

As vLLM's ``current_platform``: one object per device type answers the
engine's, config's and workers' questions (CUDA graphs or a compiled pass,
the ``auto`` dtype, memory sizing, threads, warm-up, synchronizing, the
collective backend) so that their call sites never compare device types
themselves. ``platform_for(device)`` resolves it once from the configured
device. Asking a ``CudaPlatform`` its capabilities touches no GPU; only its
methods that act (``set_device``, ``synchronize``, ``check_ranks``...) do.
An op's own choice of kernel by its tensors' device stays in the op
(paged_ref, paged_triton, the sampler): those are not process decisions.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """Device memory around a profiling pass, in bytes (kv_sizing's budget)."""

    total: int  # the device's memory
    used: int  # in use after the pass: weights, context, other processes
    peak: int  # the pass's own peak above what was allocated before it


class Platform:
    """A device type's answers; see ``CpuPlatform`` and ``CudaPlatform``."""

    device_type: ClassVar[str]
    # CUDA graphs for pure-decode steps (the worker's ``DecodeGraphs``)
    supports_cuda_graphs: ClassVar[bool]
    # torch.compile of the forward pass: where per-op Python cost dominates
    compiles_forward: ClassVar[bool]
    # warm-up compiles the Triton kernels and runs a prefill pass first
    warms_up_kernels: ClassVar[bool]
    # overlap the next step's scheduling with this step's pass by default
    async_scheduling_by_default: ClassVar[bool]
    # max_num_batched_tokens when unset (config.py's _token_budget)
    default_batched_tokens: ClassVar[int]
    # the KV pool is sized from a share of free memory by default
    sizes_kv_by_memory_share: ClassVar[bool]
    # the pool lives in device memory, measured after a profiling pass
    # (``profile_memory``, kv_sizing's device budget), rather than in host RAM
    kv_in_device_memory: ClassVar[bool]
    # ranks on one node share its RAM and cores (each takes its share)
    ranks_share_host: ClassVar[bool]
    # the engine thread waits for the event loop to write a step's outputs
    # (async_engine's HANDOFF_WAIT_S): a CPU pass holds the GIL, a GPU's not
    waits_for_event_loop: ClassVar[bool]

    def default_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        """``dtype="auto"`` for a checkpoint whose config.json names ``checkpoint_dtype``."""
        raise NotImplementedError

    def dtype_reason(self, dtype: torch.dtype) -> str:
        """Why ``auto`` chose ``dtype``, for the start-up line."""
        raise NotImplementedError

    def unavailable_reason(self) -> str | None:
        """Why this device cannot run here (one line), or None."""
        return None

    def set_device(self, device: torch.device) -> None:
        """Make ``device`` this thread's current device (nothing on a CPU)."""

    def synchronize(self, device: torch.device) -> None:
        """Wait for the work queued on ``device`` (nothing on a CPU: it ran)."""

    def profile_memory(self, device: torch.device, run: Callable[[], None]) -> MemoryProfile:
        """``device``'s memory after ``run()`` (a profiling pass) and that
        pass's peak; only where ``kv_in_device_memory`` (a CPU pool is sized
        from ``MemAvailable`` instead, kv_sizing.available_cpu_memory)."""
        raise NotImplementedError(f"{self.device_type}: the KV pool is not sized from device memory")

    def rank_device(self, device: torch.device, rank: int) -> torch.device:
        """Rank ``rank``'s device, counted from ``device``."""
        return device

    def check_ranks(self, world_size: int, device: torch.device, busy: int | None = None) -> None:
        """Raise ``ValueError`` when ``world_size`` ranks (``busy`` computing at
        once) cannot each have what they need from ``device``."""

    def check_replicas(self, replicas: int, ranks: int, device: torch.device) -> None:
        """Raise ``ValueError`` when ``replicas`` data-parallel replicas of
        ``ranks`` devices each do not fit from ``device`` on (a CPU's share
        its cores: always)."""

    def device_group(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
        """A torch.distributed group on this device's collective backend."""
        raise NotImplementedError


class CpuPlatform(Platform):
    """A CPU: eager or compiled passes, RAM-sized pools, gloo, shared cores."""

    device_type = "cpu"
    supports_cuda_graphs = False
    compiles_forward = True
    warms_up_kernels = False
    async_scheduling_by_default = False
    # keep a mixed step within a few decode steps' time (streams do not stall
    # while prompts arrive) and still run the matrix products near full speed
    default_batched_tokens = 256
    sizes_kv_by_memory_share = False
    kv_in_device_memory = False
    ranks_share_host = True
    waits_for_event_loop = True

    def default_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        """16-bit weights run in bfloat16 when the CPU has bf16 matrix units
        (AMX or AVX512-BF16: oneDNN runs bf16 GEMMs several times faster than
        fp32, as vLLM's CPU backend uses them), else in float32 (one log line
        says so: half math is slow there); a float32 checkpoint too."""
        if cpu_has_bf16():
            return torch.bfloat16
        if checkpoint_dtype in ("bfloat16", "float16"):
            log.info(
                "dtype auto: the checkpoint is %s but this CPU has no bf16 matrix units "
                "(AMX/AVX512-BF16); running in float32", checkpoint_dtype,
            )
        return torch.float32

    def dtype_reason(self, dtype: torch.dtype) -> str:
        return f"auto: CPU {'has' if dtype == torch.bfloat16 else 'has no'} AMX/AVX512-BF16"

    def check_ranks(self, world_size: int, device: torch.device, busy: int | None = None) -> None:
        """One core per rank of a stage (``busy``: one stage's ranks with
        pipeline parallelism), whose all-reduces need every one running;
        stages, whose micro-batches only wait on the stage before, may
        time-slice the same cores."""
        if (busy or world_size) > (cores := usable_cpu_cores()):
            raise ValueError(
                f"tensor_parallel_size={world_size} needs a CPU core per rank but this process may "
                f"use {cores}; lower tensor_parallel_size to at most {cores}"
            )

    def device_group(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
        import torch.distributed as dist

        return dist.ProcessGroupGloo(store, rank, size, timeout)


class CudaPlatform(Platform):
    """A GPU: decode graphs, Triton warm-up, memory profiled, NCCL, one GPU per rank."""

    device_type = "cuda"
    supports_cuda_graphs = True
    compiles_forward = False  # the decode graphs take the per-op cost away
    warms_up_kernels = True
    async_scheduling_by_default = True
    default_batched_tokens = 2048
    sizes_kv_by_memory_share = True
    kv_in_device_memory = True
    ranks_share_host = False
    waits_for_event_loop = False

    def default_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        """As vLLM: float16 stays float16; float32 (and a checkpoint that
        names none) runs in bfloat16, as vLLM downcasts it."""
        return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16

    def dtype_reason(self, dtype: torch.dtype) -> str:
        return "auto: CUDA"

    def unavailable_reason(self) -> str | None:
        if torch.cuda.is_available():
            return None
        return "device: 'cuda' requested but no CUDA GPU is available; use 'cpu' or 'auto'"

    def set_device(self, device: torch.device) -> None:
        # torch.cuda.set_device refuses a bare "cuda": it means the calling
        # thread's current device, where its tensors go; nothing to set.
        if device.index is not None:
            torch.cuda.set_device(device)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def profile_memory(self, device: torch.device, run: Callable[[], None]) -> MemoryProfile:
        """As vLLM: the caching allocator's peak during ``run()``, then the
        free and total memory the driver reports (other processes included)."""
        torch.cuda.synchronize(device)
        gc.collect()  # an engine dropped in a reference cycle still holds its pool until collected
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return MemoryProfile(total, total - free, peak)

    def rank_device(self, device: torch.device, rank: int) -> torch.device:
        """The ``rank``-th GPU from ``device``'s."""
        return torch.device("cuda", (device.index or 0) + rank)

    def check_ranks(self, world_size: int, device: torch.device, busy: int | None = None) -> None:
        """One GPU per rank, from ``device``'s on."""
        first, count = device.index or 0, torch.cuda.device_count()
        if first + world_size > count:
            raise ValueError(
                f"tensor_parallel_size={world_size} needs {world_size} GPUs from cuda:{first} on "
                f"but {count} are visible; lower it or expose more GPUs (CUDA_VISIBLE_DEVICES)"
            )

    def check_replicas(self, replicas: int, ranks: int, device: torch.device) -> None:
        """``ranks`` GPUs per replica, from ``device``'s on."""
        first, count = device.index or 0, torch.cuda.device_count()
        if first + replicas * ranks > count:
            raise ValueError(
                f"data_parallel_size: {replicas} replicas of {ranks} GPU(s) from cuda:{first} need "
                f"{first + replicas * ranks} GPUs, this machine has {count}; lower --data-parallel-size"
            )

    def device_group(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
        import torch.distributed as dist

        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)


PLATFORMS: dict[str, Platform] = {p.device_type: p for p in (CpuPlatform(), CudaPlatform())}


def platform_for(device: torch.device | str) -> Platform:
    """The platform of ``device`` (``"cpu"``, ``"cuda:1"``, a ``torch.device``)."""
    kind = torch.device(device).type
    if kind not in PLATFORMS:
        raise ValueError(f"device: {kind!r} is not supported; use 'cpu', 'cuda' or 'auto'")
    return PLATFORMS[kind]


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when there is a GPU, else CPU; a device that cannot
    run here (CUDA without a GPU) raises ``ValueError`` saying what to use."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if (reason := platform_for(device).unavailable_reason()) is not None:
        raise ValueError(reason)
    return device


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions torch uses (AMX tiles
    or AVX512-BF16). ``PAGED_CPU_BF16=0``/``1`` overrides it (the test suite
    sets 0 so that ``auto`` means float32 on every machine)."""
    forced = os.environ.get("PAGED_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    return cpu_has_amx() or bool(torch.cpu._is_avx512_bf16_supported())


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (oneDNN's and inductor's bf16 GEMMs
    pick their kernels by it)."""
    return bool(torch.cpu._is_amx_tile_supported())


def usable_cpu_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under taskset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
