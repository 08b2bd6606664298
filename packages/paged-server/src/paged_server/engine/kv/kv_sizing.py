"""How many KV tokens the pool gets, and why (the start-up line says it).

In order of precedence:
1. ``num_gpu_blocks``: that many blocks.
2. ``kv_cache_memory_bytes``: as many as that budget holds.
3. ``gpu_memory_utilization`` (default 0.9 on CUDA; on CPU only when set):
   - CUDA, as vLLM: with the weights loaded, run one profiling forward pass
     of ``max_num_batched_tokens`` tokens (logits for every row, the most a
     step can need, ``prompt_logprobs`` included); the pool gets
     ``total * utilization - used - activation peak`` where ``used`` is the
     device memory in use afterwards (weights, CUDA context, other
     processes), as the platform measures it (``Platform.profile_memory``).
   - CPU: ``utilization`` times ``MemAvailable`` (``/proc/meminfo``, read
     after the weights are loaded).
4. Otherwise (CPU default): ``max_batch_size * max_model_len`` tokens, the
   contiguous pool's capacity, so the two layouts compare like for like and
   tests stay small; at most ``CPU_DEFAULT_KV_BYTES`` (4 GiB) or one
   whole sequence, whichever is more.

A budget that holds no block refuses to start, saying what used the memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from paged_server.config import EngineConfig
from paged_server.platform import platform_for

GIB = 1024**3
DEFAULT_CUDA_UTILIZATION = 0.9
# The CPU default pool (max_batch_size x max_model_len) is capped here (or
# at one whole sequence, if more), as vLLM's CPU backend defaults to a fixed
# KV space: with max_model_len from the model (32k-128k) the uncapped
# product would not fit any machine.
CPU_DEFAULT_KV_BYTES = 4 * GIB


@dataclass(slots=True)
class KVBudget:
    """Blocks for the paged pool (or bytes for the contiguous one) and how
    they were chosen, in words for the start-up line."""

    num_bytes: int | None  # None: no memory budget (fixed count / default)
    num_blocks: int | None  # paged only: an explicit count
    sized_by: str


def sizes_by_memory_share(config: EngineConfig, device: torch.device) -> bool:
    """Whether ``kv_budget`` will size the pool from free memory (a share of
    it), rather than from an explicit size or the CPU default."""
    if config.num_gpu_blocks is not None or config.kv_cache_memory_bytes is not None:
        return False
    return config.gpu_memory_utilization is not None or platform_for(device).sizes_kv_by_memory_share


def kv_budget(
    config: EngineConfig,
    token_bytes: int,
    device: torch.device,
    model: nn.Module | None,
    local_ranks: int = 1,
) -> KVBudget:
    """The budget ``config`` asks for on ``device`` (see the module docstring);
    ``local_ranks``: ranks sharing this CPU's RAM, each sized from its share."""
    if config.num_gpu_blocks is not None:
        return KVBudget(None, config.num_gpu_blocks, "--num-gpu-blocks")
    if config.kv_cache_memory_bytes is not None:
        return KVBudget(config.kv_cache_memory_bytes, None, "--kv-cache-memory-bytes")
    if not sizes_by_memory_share(config, device):
        wanted = config.max_batch_size * (config.max_model_len or 0) * token_bytes
        if wanted > CPU_DEFAULT_KV_BYTES:  # a model's full context (40960) x 64 sequences
            one = (config.max_model_len or 0) * token_bytes  # at least one whole sequence
            cap = max(CPU_DEFAULT_KV_BYTES, one)
            if one > CPU_DEFAULT_KV_BYTES and one > (available := available_cpu_memory()):
                raise ValueError(
                    f"max_model_len: one sequence of {config.max_model_len} tokens needs "
                    f"{one / GIB:.1f} GiB of KV cache, more than the {available / GIB:.1f} GiB "
                    "of available memory; lower --max-model-len or size the cache with "
                    "--kv-cache-memory-bytes"
                )
            return KVBudget(
                cap, None,
                f"the CPU default cap of {cap / GIB:.3g} GiB (max_batch_size x "
                f"max_model_len would take {wanted / GIB:.1f} GiB; set --kv-cache-memory-bytes)",
            )
        return KVBudget(None, None, "max_batch_size x max_model_len (CPU default)")
    utilization = config.gpu_memory_utilization
    if utilization is None:  # CUDA's default share
        utilization = DEFAULT_CUDA_UTILIZATION
    if platform_for(device).kv_in_device_memory:
        num_bytes, how = _device_budget(config, utilization, device, model)
    else:
        available = available_cpu_memory()
        num_bytes = int(available * utilization) // local_ranks
        shared = f", shared by {local_ranks} ranks" if local_ranks > 1 else ""
        how = (
            f"--gpu-memory-utilization {utilization:g} of {available / GIB:.2f} GiB available "
            f"RAM (MemAvailable){shared}"
        )
    if num_bytes < token_bytes * config.block_size:
        raise ValueError(
            f"gpu_memory_utilization: no room for the KV cache: {how} leaves "
            f"{max(num_bytes, 0) / GIB:.3f} GiB, less than one block of {config.block_size} "
            f"tokens ({token_bytes * config.block_size} bytes); raise "
            "--gpu-memory-utilization, lower --max-num-batched-tokens, use a smaller "
            "--dtype, or set --num-gpu-blocks / --kv-cache-memory-bytes"
        )
    return KVBudget(num_bytes, None, how)


def available_cpu_memory() -> int:
    """Bytes the OS could give this process now (``MemAvailable``)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ValueError(
        "gpu_memory_utilization: cannot read the available RAM here (no /proc/meminfo); "
        "size the CPU pool with --kv-cache-memory-bytes or --num-gpu-blocks"
    )


def _device_budget(
    config: EngineConfig, utilization: float, device: torch.device, model: nn.Module | None
) -> tuple[int, str]:
    def run() -> None:
        if model is not None:
            profile_forward(model, config.max_num_batched_tokens or 2048, device)

    memory = platform_for(device).profile_memory(device, run)
    num_bytes = int(memory.total * utilization) - memory.used - memory.peak
    how = (
        f"--gpu-memory-utilization {utilization:g} of {memory.total / GIB:.1f} GiB: "
        f"{memory.used / GIB:.2f} GiB in use after loading (weights, CUDA context, other "
        f"processes), {memory.peak / GIB:.2f} GiB peak of a "
        f"{config.max_num_batched_tokens}-token profiling step"
    )
    return num_bytes, how


@torch.inference_mode()
def profile_forward(model: nn.Module, num_tokens: int, device: torch.device) -> None:
    """One forward pass of ``num_tokens`` tokens without a cache, logits for
    every row: at least the activation memory of any real step. A pipeline
    stage runs its own layers (from zero activations after the first stage;
    the LM head on the last)."""
    ids = torch.zeros((1, num_tokens), dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device).unsqueeze(0)
    stage = getattr(model, "pp", None)
    intermediate = None
    if stage is not None and not stage.is_first:
        dtype = next(model.parameters()).dtype
        intermediate = torch.zeros(1, num_tokens, model.config.hidden_size, dtype=dtype, device=device)
    hidden = model.hidden_states(ids, positions, None, intermediate)  # type: ignore[operator]
    if stage is None or stage.is_last:
        model.compute_logits(hidden)  # type: ignore[operator]

