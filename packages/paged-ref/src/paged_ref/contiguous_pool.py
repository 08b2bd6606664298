"""Contiguous KV cache pool: one fixed ``max_model_len`` row per seq_id.

The baseline the paged pool is measured against: every seq_id reserves
``max_model_len`` positions up front, so capacity is per seq_id, not per token.
It satisfies ``ServingPoolProtocol`` with no prefix cache (always 0 cached
tokens) and forks by copying rows (``ContiguousKVManager``).

Its tensors have the paged pool's layout with one block per seq_id
(``[layers, seq_ids, max_model_len, kv_heads, head_dim]``: block id = seq_id,
block size = ``max_model_len``), so both pools share one view class and one
set of attention ops; only the bookkeeping differs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from paged_ref.contiguous_manager import ContiguousKVManager
from paged_ref.kv_pool import KVPool
from paged_ref.kv_spec import KVCacheSpec
from paged_ref.kv_tensors import KVCacheTensors


class ContiguousKVPool(KVPool):
    """``k_cache``/``v_cache``: ``[layers, max_batch_size, max_model_len, kv_heads, head_dim]``."""

    manager: ContiguousKVManager

    def __init__(
        self,
        k_cache: Tensor,
        v_cache: Tensor,
        *,
        ops: Any = None,
        k_scales: Tensor | None = None,
        v_scales: Tensor | None = None,
        kv_scales: tuple[Tensor, Tensor] | None = None,
    ) -> None:
        # The contiguous baseline attends with the reference ops unless told otherwise.
        tensors = KVCacheTensors(
            k_cache, v_cache, paged=False, ops=ops, k_scales=k_scales, v_scales=v_scales,
            kv_scales=kv_scales,
        )  # fmt: skip
        super().__init__(ContiguousKVManager(tensors.num_blocks, tensors.block_size), tensors)

    @staticmethod
    def from_spec(
        spec: KVCacheSpec,
        max_batch_size: int,
        device: str | torch.device = "cpu",
        *,
        ops: Any = None,
        kv_scales: tuple[Tensor, Tensor] | None = None,
    ) -> ContiguousKVPool:
        """``max_batch_size`` zeroed rows of ``spec.block_size`` (= ``max_model_len``) tokens."""
        t = KVCacheTensors.allocate(spec, max_batch_size, device, paged=False, ops=ops, kv_scales=kv_scales)
        return ContiguousKVPool(
            t.k_cache, t.v_cache, ops=t.backend, k_scales=t.k_scales, v_scales=t.v_scales, kv_scales=kv_scales
        )

    @staticmethod
    def from_model_config(
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_model_len: int,
        max_batch_size: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        ops: Any = None,
        kv_cache_dtype: str = "auto",
        kv_scales: tuple[Tensor, Tensor] | None = None,
    ) -> ContiguousKVPool:
        """A zeroed pool for a model's shape (pass ``device="meta"`` to size it
        without allocating memory); ``kv_cache_dtype`` and ``kv_scales`` as
        for the paged pool."""
        spec = KVCacheSpec.dense(
            num_layers, num_kv_heads, head_dim, dtype, kv_cache_dtype=kv_cache_dtype,
            block_size=max_model_len, static_scales=kv_scales is not None,
        )  # fmt: skip
        return ContiguousKVPool.from_spec(spec, max_batch_size, device, ops=ops, kv_scales=kv_scales)

    # -- what tests and benchmarks read ------------------------------------------
    @property
    def max_batch_size(self) -> int:
        return self.manager.max_batch_size

    @property
    def max_model_len(self) -> int:
        return self.manager.max_model_len

    @property
    def seq_lens(self) -> list[int]:
        return self.manager.seq_lens

    @property
    def num_layers(self) -> int:
        return int(self.tensors.num_layers)

    # The names the attention ops take for the two tensors.
    @property
    def k(self) -> Tensor:
        return self.k_cache

    @property
    def v(self) -> Tensor:
        return self.v_cache
