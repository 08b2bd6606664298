"""Build the KV cache pool an engine config asks for, sized for the model.

The one place that names the concrete pool classes; everything after it
talks to the pool through ``ServingPoolProtocol`` only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from paged_core.kv_cache_groups import KVCacheGroup, kv_cache_groups, stage_groups
from paged_core.protocols import ServingPoolProtocol
from paged_ref import ContiguousKVPool, PagedKVPool
from paged_ref import ops as ref_ops
from paged_ref.kv_quant import cache_dtype_for, kv_bytes_per_token
from paged_server.config import EngineConfig
from paged_server.engine.kv_calibration import (
    KVScales,
    calculate_kv_scales,
    calibration_token_ids,
)
from paged_server.engine.kv_sizing import blocks_in, kv_budget
from paged_server.models import LoadedModel, ModelConfig
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
    group_windows: tuple[int | None, ...] = (None,)  # each KV cache group's sliding window

    @property
    def num_groups(self) -> int:
        """KV cache groups sharing the blocks (1 unless a paged pool is hybrid)."""
        return len(self.group_windows)

    @property
    def num_tensor_blocks(self) -> int:
        """Blocks of the cache tensors: ``num_blocks`` plus the null block
        a pool with sliding groups reserves."""
        return self.num_blocks + any(w is not None for w in self.group_windows)

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
        """Blocks one sequence needs at its peak: its prompt in every group
        (taken at admission), or ``kv_tokens`` in full groups and at most a
        window + 1 block in sliding ones, whichever is more."""
        bs = self.block_size
        blocks = -(-kv_tokens // bs)
        peak = sum(
            blocks if w is None else min(blocks, -(-w // bs) + 1) for w in self.group_windows
        )
        return max(peak, self.num_groups * -(-prompt_len // bs))


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


def attention_ops(backend: str) -> ModuleType:
    """The attention ops module for ``"ref"`` or ``"triton"``."""
    if backend == "triton":
        from paged_triton import ops as triton_ops

        return triton_ops
    from paged_ref import ops as ref_ops

    return ref_ops


def build_cache_pool(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    backend: str,
    model: nn.Module | None = None,
    *,
    num_kv_heads: int | None = None,
    wrap_ops: Callable[[ModuleType], ModuleType] | None = None,
    kv_scales: KVScales | None = None,
    pp: PipelineStage = WHOLE,
) -> tuple[ServingPoolProtocol, PoolCapacity]:
    """A zeroed pool for ``model_config`` and its capacity: ``paged_pool``
    or ``contiguous_pool`` as ``kv_cache_backend`` says.

    With tensor parallelism the pool holds only this rank's ``num_kv_heads``
    (default: all of the model's), so a per-device budget buys more tokens;
    ``wrap_ops`` wraps the attention ops the pool uses (rank 0 records its
    block copies that way). With pipeline parallelism (``pp``) the pool
    holds only the stage's layers, with the same blocks on every stage.
    Bytes are those of ``kv_cache_dtype`` (int8
    per-token scales included), so an 8-bit cache gets about twice the
    tokens from the same memory budget; with ``kv_scales`` (from
    :func:`calibrated_kv_scales`) the pool keeps static scales instead and
    int8 gets exactly twice.
    The contiguous pool attends with the reference path whatever ``backend``.
    """
    if config.calculate_kv_scales and kv_scales is None:
        raise ValueError("calculate_kv_scales: pass kv_scales=calibrated_kv_scales(...) to build the pool")
    shape = _KVShape(
        model_config.num_layers, num_kv_heads or model_config.num_kv_heads, model_config.head_dim,
        dtype, cache_dtype_for(config.kv_cache_dtype, dtype), kv_scales,
    )  # fmt: skip
    paged = config.kv_cache_backend == "paged"
    ops = attention_ops(backend) if paged else ref_ops
    ops = wrap_ops(ops) if wrap_ops is not None else ops
    if paged:
        stage = for_stage(pp, model_config.num_layers)
        return paged_pool(config, model_config.layer_sliding_windows, shape, device, model, ops, stage)
    if pp.size > 1:
        raise ValueError("pipeline parallelism needs kv_cache_backend='paged'")
    return contiguous_pool(config, shape, device, model, ops)


@dataclass(frozen=True, slots=True)
class _KVShape:
    """What one token's K/V is made of: the pool's layers, kv heads and
    head size, the model's dtype, what the cache stores and its scales."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_dtype: torch.dtype
    kv_scales: KVScales | None

    @property
    def static(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.kv_scales is None else (self.kv_scales.k, self.kv_scales.v)

    def token_bytes(self, num_layers: int, block_size: int) -> int:
        """Bytes one token takes over ``num_layers`` layers (int8 per-token
        scales included; an int4 token's share of its ``block_size`` block's
        key scales)."""
        static = self.kv_scales is not None
        return kv_bytes_per_token(
            num_layers, self.kv_heads, self.head_dim, self.kv_dtype, static, block_size=block_size
        )


def paged_pool(
    config: EngineConfig, layer_windows: list[int | None], shape: _KVShape, device: torch.device,
    model: nn.Module | None, ops: ModuleType, stage: PipelineStage | None = None,
) -> tuple[ServingPoolProtocol, PoolCapacity]:  # fmt: skip
    """The paged pool: ``num_gpu_blocks``, else as many blocks as the memory
    budget (``kv_cache_memory_bytes``, else ``gpu_memory_utilization``, see
    ``kv_sizing``; ``model`` runs its profiling pass) holds, else
    ``max_batch_size * max_model_len / block_size`` in every KV cache group.
    The groups are computed here, once, and handed to the pool.

    A pipeline stage (``stage``) keeps each group's layers it holds
    (``stage_groups``); every stage has the same block ids (rank 0's block
    manager hands them out), so the count is the one the stage with the
    most cache layers can afford from the budget, computed alike on every
    rank (vLLM also takes the least over its workers)."""
    groups = kv_cache_groups(layer_windows, hybrid=not config.disable_hybrid_kv_cache_manager)
    sliding = any(g.sliding_window is not None for g in groups)
    bs = config.block_size
    num_layers = len(layer_windows)
    stage = stage or for_stage(WHOLE, num_layers)
    per_stage = [stage_groups(groups, stage_layers(num_layers, r, stage.size)) for r in range(stage.size)]
    widest = max(max(len(g.layers) for g in s) for s in per_stage)  # the fullest stage's cache layers
    slot_bytes = shape.token_bytes(widest, bs)  # a block holds one group's layers (of one stage)
    model_groups, groups = groups, per_stage[stage.rank]
    local_bytes = shape.token_bytes(max(len(g.layers) for g in groups), bs)
    budget = kv_budget(config, slot_bytes, device, model)
    num_blocks = budget.num_blocks
    if num_blocks is None and budget.num_bytes is not None:
        num_blocks = blocks_in(budget.num_bytes, slot_bytes, bs)
        if num_blocks < 1 + sliding:
            raise ValueError(
                f"kv_cache_memory_bytes ({budget.num_bytes}) holds no KV block "
                f"of {slot_bytes * bs} bytes; raise it or lower block_size"
            )
    if num_blocks is None:  # the contiguous pool's tokens, in every group (+ the null block)
        num_blocks = math.ceil(config.max_batch_size * config.max_model_len / bs) * len(groups) + sliding
    pool = PagedKVPool.from_model_config(
        sum(len(g.layers) for g in groups), shape.kv_heads, shape.head_dim, num_blocks, bs,
        shape.dtype, device, enable_prefix_caching=config.enable_prefix_caching, ops=ops,
        kv_cache_dtype=config.kv_cache_dtype, kv_scales=shape.static, groups=groups,
    )  # fmt: skip
    usable = num_blocks - sliding  # a sliding group's null block is never handed out
    return pool, PoolCapacity(
        usable, bs, None, usable * bs // len(groups), shape.kv_dtype,
        num_blocks * bs * local_bytes, budget.sized_by, shape.kv_scales,
        describe_groups(model_groups), tuple(g.sliding_window for g in groups),
    )  # fmt: skip


def contiguous_pool(
    config: EngineConfig, shape: _KVShape, device: torch.device, model: nn.Module | None,
    ops: ModuleType,
) -> tuple[ServingPoolProtocol, PoolCapacity]:  # fmt: skip
    """The contiguous pool: ``max_batch_size`` rows of ``max_model_len``
    tokens, fewer if the memory budget holds fewer."""
    # (int4: a row is one block, so its key scales are per group of that row)
    token_bytes = shape.token_bytes(shape.num_layers, config.max_model_len)
    budget = kv_budget(config, token_bytes, device, model)
    rows = config.max_batch_size
    if budget.num_bytes is not None:
        rows = min(rows, budget.num_bytes // (token_bytes * config.max_model_len))
        if rows < 1:
            raise ValueError(
                f"kv_cache_memory_bytes ({budget.num_bytes}) holds no contiguous "
                f"row of {token_bytes * config.max_model_len} bytes (max_model_len "
                f"{config.max_model_len}); raise it or lower max_model_len"
            )
    pool = ContiguousKVPool.from_model_config(
        shape.num_layers, shape.kv_heads, shape.head_dim, config.max_model_len, rows,
        dtype=shape.dtype, device=device, ops=ops, kv_cache_dtype=config.kv_cache_dtype,
        kv_scales=shape.static,
    )  # fmt: skip
    tokens = rows * config.max_model_len
    sized_by = budget.sized_by if budget.num_bytes is not None else "max_batch_size rows"
    return pool, PoolCapacity(
        tokens // config.block_size, config.block_size, rows, tokens, shape.kv_dtype,
        tokens * token_bytes, sized_by, shape.kv_scales,
    )  # fmt: skip


def calibrated_kv_scales(
    config: EngineConfig, loaded: LoadedModel, num_kv_heads: int | None = None
) -> KVScales:
    """``calculate_kv_scales``: one pass of ``loaded``'s model over the
    calibration text through a small reference pool in the model's dtype
    (freed afterwards), recording each layer's K/V absmax per kv head
    (``engine/kv_calibration.py``). Runs before the serving pool is built."""
    mc = loaded.config
    kv_heads = num_kv_heads or mc.num_kv_heads
    device = next(loaded.model.parameters()).device
    token_ids = calibration_token_ids(loaded.tokenizer.encode, config.max_model_len)
    block_size = 16
    pool = PagedKVPool.from_model_config(
        mc.num_layers, kv_heads, mc.head_dim, -(-len(token_ids) // block_size), block_size,
        loaded.dtype, device, enable_prefix_caching=False,
    )  # fmt: skip
    return calculate_kv_scales(
        loaded.model, token_ids, pool, mc.num_layers, kv_heads,
        cache_dtype_for(config.kv_cache_dtype, loaded.dtype),
    )  # fmt: skip
