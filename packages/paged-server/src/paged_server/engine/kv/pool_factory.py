"""The KV cache an engine config asks for: its size, its capacity, its manager.

The one place that names the concrete cache classes: each rank's worker
sizes its part of the cache (``cache_size``), the engine core builds the
scheduler's side (``build_kv_manager``) over the blocks every rank can
hold and reports them (``PoolCapacity``); ``build_cache_pool`` joins both
sides in one object for tests and benchmarks. Everything after it talks to
the manager through ``KVCacheManagerProtocol`` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paged_core.kv_cache_groups import KVCacheGroup, kv_cache_groups
from paged_core.protocols import ServingPoolProtocol
from paged_ref.contiguous_manager import ContiguousKVManager
from paged_ref.kv_pool import KVPool
from paged_ref.kv_spec import KVCacheSpec
from paged_ref.kv_tensors import KVCacheTensors
from paged_ref.paged_manager import PagedKVManager
from paged_server import attention_backends
from paged_server.config import EngineConfig
from paged_server.engine.kv.kv_calibration import KVScales
from paged_server.engine.kv.kv_sizing import kv_budget
from paged_server.models import ModelConfig
from paged_server.models.pipeline_parallel import WHOLE, PipelineStage, for_stage, stage_layers


@dataclass(slots=True)
class PoolCapacity:
    """Total KV capacity: ``num_blocks`` of ``block_size`` tokens (paged), or
    ``num_rows`` rows of ``max_model_len`` tokens (contiguous; ``num_blocks``
    is then its size in block-equivalents, for comparisons).

    With ``num_groups`` KV cache groups (a hybrid model: sliding-window
    layers apart from global ones) a block holds one group's layers, and
    ``tokens`` is ``num_blocks * block_size / num_groups``: what fits when
    every group holds every token, i.e. sequences no longer than the window.
    Longer sequences fit more, their sliding groups holding only a window."""

    num_blocks: int
    block_size: int
    num_rows: int | None
    tokens: int
    kv_dtype: torch.dtype  # what the cache stores (the model dtype, or an 8-bit one)
    kv_bytes: int  # the pool's K/V tensors (and int8 per-token scales), bytes
    sized_by: str = ""  # how the size was chosen (the start-up line says it)
    kv_scales: KVScales | None = None  # static scales (calculate_kv_scales), else None
    groups: str = ""  # the groups in words, for the start-up line
    spec: KVCacheSpec | None = None  # the layout (this rank's), when paged

    @property
    def num_groups(self) -> int:
        """KV cache groups sharing the blocks (1 unless a paged pool is hybrid)."""
        return 1 if self.spec is None else len(self.spec.groups)

    @property
    def num_tensor_blocks(self) -> int:
        """Blocks of the cache tensors: ``num_blocks`` plus the null block
        a pool with sliding groups reserves."""
        return self.num_blocks + (0 if self.spec is None else self.spec.num_null_blocks)

    @property
    def longest_prompt(self) -> int:
        """Tokens one sequence can take at once: a row of the contiguous pool;
        in a paged one, whose prompts are reserved in every KV cache group at
        admission, each group's share of the blocks (nor can a step compute
        more tokens: each takes a slot in every group)."""
        if self.num_rows is not None:
            return self.tokens // self.num_rows
        return self.num_blocks // self.num_groups * self.block_size

    def blocks_for(self, prompt_len: int, kv_tokens: int) -> int:
        """Blocks one sequence needs at its peak (``KVCacheSpec.blocks_for``;
        the contiguous pool's row counts as whole blocks)."""
        if self.spec is None:
            return max(-(-kv_tokens // self.block_size), -(-prompt_len // self.block_size))
        return self.spec.blocks_for(prompt_len, kv_tokens)


def describe_groups(groups: list[KVCacheGroup]) -> str:
    """``"13 KV cache groups of 2 layers: 2 full, 11 sliding (window 512)"``."""
    if len(groups) == 1:
        return ""
    windows = sorted({g.sliding_window for g in groups if g.sliding_window is not None})
    full = sum(1 for g in groups if g.sliding_window is None)
    return (
        f"{len(groups)} KV cache groups of {len(groups[0].layers)} layers: {full} full, "
        f"{len(groups) - full} sliding (window {', '.join(map(str, windows))})"
    )


def cache_size(
    config: EngineConfig, spec: KVCacheSpec, device: torch.device, model: nn.Module | None,
    local_ranks: int = 1,
) -> tuple[int, str]:  # fmt: skip
    """How big the cache ``spec`` describes (this rank's layers) may be, and
    why, for the start-up line: paged, its blocks (the null block sliding
    windows keep included): ``num_gpu_blocks``, else as many as the memory
    budget holds (``kv_cache_memory_bytes``, else ``gpu_memory_utilization``,
    see ``kv_sizing``; ``model`` runs its profiling pass; a CPU's RAM is
    shared by its ``local_ranks``), else ``max_batch_size * max_model_len /
    block_size`` in every KV cache group; contiguous, its rows of
    ``max_model_len``: ``max_batch_size``, fewer if the budget holds fewer.
    Every rank computes its own; the engine takes the least (vLLM does too),
    so that a pipeline stage with more cache layers bounds them all."""
    budget = kv_budget(config, spec.token_bytes(), device, model, local_ranks)
    if config.kv_cache_backend != "paged":
        if budget.num_bytes is None:
            return config.max_batch_size, "max_batch_size rows"
        rows = min(config.max_batch_size, spec.blocks_in(budget.num_bytes))
        if rows < 1:
            raise ValueError(
                f"kv_cache_memory_bytes ({budget.num_bytes}) holds no contiguous "
                f"row of {spec.block_bytes()} bytes (max_model_len "
                f"{config.max_model_len}); raise it or lower max_model_len"
            )
        return rows, budget.sized_by
    null = spec.num_null_blocks
    if budget.num_blocks is not None:
        return budget.num_blocks, budget.sized_by
    if budget.num_bytes is not None:
        num_blocks = spec.blocks_in(budget.num_bytes)
        if num_blocks < 1 + null:
            raise ValueError(
                f"kv_cache_memory_bytes ({budget.num_bytes}) holds no KV block "
                f"of {spec.block_bytes()} bytes; raise it or lower block_size"
            )
        return num_blocks, budget.sized_by
    # the contiguous pool's tokens, in every group (+ the null block)
    per_group = math.ceil(config.max_batch_size * config.max_model_len / spec.block_size)
    return per_group * len(spec.groups) + null, budget.sized_by


def pool_capacity(
    config: EngineConfig, spec: KVCacheSpec, num_blocks: int, sized_by: str,
    kv_scales: KVScales | None = None, local: KVCacheSpec | None = None,
) -> PoolCapacity:  # fmt: skip
    """The capacity of a cache of ``num_blocks`` blocks (rows, contiguous)
    laid out as ``spec``; ``local``: the part this rank stores (its
    pipeline stage's layers), whose bytes the start-up line reports."""
    local = local or spec
    if config.kv_cache_backend != "paged":
        tokens = num_blocks * config.max_model_len
        return PoolCapacity(
            tokens // config.block_size, config.block_size, num_blocks, tokens, spec.cache_dtype,
            num_blocks * local.block_bytes(), sized_by, kv_scales,
        )  # fmt: skip
    usable = num_blocks - spec.num_null_blocks  # a sliding group's null block is never handed out
    return PoolCapacity(
        usable, spec.block_size, None, spec.tokens_in(usable), spec.cache_dtype,
        num_blocks * local.block_bytes(), sized_by, kv_scales, describe_groups(list(spec.groups)),
        spec,
    )  # fmt: skip


def build_kv_manager(config: EngineConfig, spec: KVCacheSpec, num_blocks: int) -> Any:
    """The scheduler's side of the cache: ``PagedKVManager`` over ``num_blocks``
    blocks, or ``ContiguousKVManager`` over that many rows."""
    if config.kv_cache_backend != "paged":
        return ContiguousKVManager(num_blocks, config.max_model_len)
    return PagedKVManager(
        num_blocks, spec.block_size, enable_prefix_caching=config.enable_prefix_caching,
        sliding_windows=spec.windows,
    )  # fmt: skip


def build_cache_pool(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    backend: str,
    model: nn.Module | None = None,
    *,
    num_kv_heads: int | None = None,
    kv_scales: KVScales | None = None,
    pp: PipelineStage = WHOLE,
) -> tuple[ServingPoolProtocol, PoolCapacity]:
    """A zeroed pool joining both sides (``paged_ref.kv_pool``) for
    ``model_config``, sized as an engine would size it, and its capacity
    (tests, benchmarks; the engine keeps the sides apart).

    With tensor parallelism the pool holds only this rank's ``num_kv_heads``
    (default: all of the model's); with pipeline parallelism (``pp``) only
    the stage's layers. With ``kv_scales`` (``calculate_kv_scales``) an 8-bit
    pool keeps static scales. The contiguous pool attends with the reference
    path whatever ``backend``."""
    if config.calculate_kv_scales and kv_scales is None:
        raise ValueError("calculate_kv_scales: pass kv_scales=calibrate_kv_scales(...) to build the pool")
    paged = config.kv_cache_backend == "paged"
    if pp.size > 1 and not paged:
        raise ValueError("pipeline parallelism needs kv_cache_backend='paged'")
    groups = kv_cache_groups(
        model_config.layer_sliding_windows, hybrid=paged and not config.disable_hybrid_kv_cache_manager
    )
    spec = KVCacheSpec(
        tuple(groups), num_kv_heads or model_config.num_kv_heads, model_config.head_dim, dtype,
        config.kv_cache_dtype, config.block_size if paged else config.max_model_len,
        static_scales=kv_scales is not None,
    )  # fmt: skip
    stage = for_stage(pp, model_config.num_layers)
    stages = [spec.for_stage(stage_layers(spec.num_layers, r, stage.size)) for r in range(stage.size)]
    num_blocks = min(cache_size(config, s, device, model)[0] for s in stages)
    sized_by = cache_size(config, stages[stage.rank], device, model)[1]
    local = stages[stage.rank]
    ops = attention_backends.build(backend, paged=paged)
    scales = None if kv_scales is None else (kv_scales.k, kv_scales.v)
    tensors = KVCacheTensors.allocate(local, num_blocks, device, paged=paged, ops=ops, kv_scales=scales)
    pool = KVPool(build_kv_manager(config, spec, num_blocks), tensors)
    return pool, pool_capacity(config, spec, num_blocks, sized_by, kv_scales, local)
