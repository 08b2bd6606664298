"""Block-paged KV cache pool: ``PagedKVManager``'s page tables over ``KVCacheTensors``' blocks.

``k_cache``/``v_cache`` are ``[cache_layers, num_blocks, block_size, kv_heads,
head_dim]`` (a token's K for all heads is one contiguous row, so writes are
row copies and a gathered context is a strided view, not a permute); a seq_id
is a sequence id of the block manager. The layers form KV cache groups
(``paged_core.kv_cache_groups``): one group of every layer unless sliding
windows make the model hybrid; then each group of ``k`` layers has its own
page tables over the shared blocks and layer ``l`` lives at cache layer ``j``
of the tensors (``locate_layer``). The views write and attend through an
attention backend (``ops``: the reference by default; the server passes
Triton's, so this package never imports triton; a bare ops module runs as
``ops_backend.OpsBackend``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from paged_core.block_manager import DEFAULT_BLOCK_SIZE, BlockManager
from paged_core.kv_cache_groups import KVCacheGroup
from paged_ref.kv_pool import KVPool
from paged_ref.kv_spec import KVCacheSpec
from paged_ref.kv_tensors import KVCacheTensors
from paged_ref.paged_manager import PagedKVManager


class PagedKVPool(KVPool):
    """A block pool satisfying ``ServingPoolProtocol`` (see module doc).

    A seq_id's length (``get_num_computed_tokens``) counts tokens whose KV is committed;
    ``get_num_reserved`` counts tokens with room reserved, which is more
    between ``append_token`` and the step that writes the token.
    """

    manager: PagedKVManager

    def __init__(
        self,
        k_cache: Tensor,
        v_cache: Tensor,
        *,
        enable_prefix_caching: bool = True,
        ops: Any = None,
        k_scales: Tensor | None = None,
        v_scales: Tensor | None = None,
        kv_scales: tuple[Tensor, Tensor] | None = None,
        groups: Sequence[KVCacheGroup] | None = None,
    ) -> None:
        tensors = KVCacheTensors(
            k_cache, v_cache, ops=ops, k_scales=k_scales, v_scales=v_scales, kv_scales=kv_scales,
            groups=groups,
        )  # fmt: skip
        manager = PagedKVManager(
            tensors.num_blocks, tensors.block_size, enable_prefix_caching=enable_prefix_caching,
            sliding_windows=[g.sliding_window for g in tensors.groups],
        )  # fmt: skip
        super().__init__(manager, tensors)

    @staticmethod
    def from_spec(
        spec: KVCacheSpec,
        num_blocks: int,
        device: str | torch.device = "cpu",
        *,
        enable_prefix_caching: bool = True,
        ops: Any = None,
        kv_scales: tuple[Tensor, Tensor] | None = None,
    ) -> PagedKVPool:
        """A zeroed pool of ``num_blocks`` blocks (the null block included)
        laid out as ``spec`` says (``device="meta"`` sizes it without memory)."""
        tensors = KVCacheTensors.allocate(spec, num_blocks, device, ops=ops, kv_scales=kv_scales)
        return PagedKVPool(
            tensors.k_cache, tensors.v_cache, enable_prefix_caching=enable_prefix_caching,
            ops=tensors.backend, k_scales=tensors.k_scales, v_scales=tensors.v_scales,
            kv_scales=kv_scales, groups=spec.groups,
        )  # fmt: skip

    @staticmethod
    def from_model_config(
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        *,
        enable_prefix_caching: bool = True,
        ops: Any = None,
        kv_cache_dtype: str = "auto",
        kv_scales: tuple[Tensor, Tensor] | None = None,
        groups: Sequence[KVCacheGroup] | None = None,
    ) -> PagedKVPool:
        """A zeroed pool of ``num_blocks`` blocks for a model's shape
        (``device="meta"`` sizes it without allocating memory). ``dtype`` is
        the model's; ``kv_cache_dtype`` (``auto``, ``fp8``, ``fp8_e4m3``,
        ``fp8_e5m2``, ``int8``, ``int4``) picks what the blocks store; ``kv_scales``
        (static K and V scales, ``[num_layers, num_kv_heads]``, from
        ``calculate_kv_scales``) replaces int8's per-token scales and fp8's
        scale of 1. ``groups``: the model's KV cache groups
        (``paged_core.kv_cache_groups``; default one group of every layer);
        with several, a block holds one group's layers, so it costs fewer
        bytes, and sliding groups free old blocks. A pipeline stage passes
        its ``stage_groups`` and ``num_layers`` = the layers they hold."""
        groups = tuple(groups or [KVCacheGroup(tuple(range(num_layers)), None)])
        if sum(len(g.layers) for g in groups) != num_layers:
            raise ValueError(f"the KV cache groups hold {sum(len(g.layers) for g in groups)} layers, not {num_layers}")
        spec = KVCacheSpec(
            groups, num_kv_heads, head_dim, dtype, kv_cache_dtype, block_size,
            static_scales=kv_scales is not None,
        )  # fmt: skip
        return PagedKVPool.from_spec(
            spec, num_blocks, device, enable_prefix_caching=enable_prefix_caching, ops=ops,
            kv_scales=kv_scales,
        )  # fmt: skip

    # -- what tests, benchmarks and the audit read --------------------------------
    @property
    def block_manager(self) -> BlockManager:
        return self.manager.block_manager

    @property
    def groups(self) -> list[KVCacheGroup]:
        return self.tensors.groups

    @property
    def num_blocks(self) -> int:
        return int(self.tensors.num_blocks)

    @property
    def num_layers(self) -> int:
        return int(self.tensors.num_layers)

    @property
    def num_cache_layers(self) -> int:
        return int(self.tensors.num_cache_layers)

    @property
    def num_kv_heads(self) -> int:
        return int(self.tensors.num_kv_heads)

    @property
    def head_dim(self) -> int:
        return int(self.tensors.head_dim)

    def block_table(self, seq_id: int, group: int = 0) -> list[int]:
        """The seq_id's block ids in token order."""
        return self.manager.block_table(seq_id, group)
