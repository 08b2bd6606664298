"""One frozen description of a KV cache's layout: ``KVCacheSpec``.

What a token and a block of the cache are made of (the layers a block
spans, kv heads, head size, the dtype stored, the block size and the KV
cache groups), and the arithmetic every sizing decision needs: bytes per
token and per block, blocks in a byte budget, blocks a sequence needs.
The scheduler's side (the block manager: how many blocks, which windows)
and the worker's side (the tensors) are both built from one spec, so the
two can never disagree on the layout. A contiguous cache is the same spec
with one "block" of ``max_model_len`` tokens per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from paged_core.block_manager import DEFAULT_BLOCK_SIZE
from paged_core.kv_cache_groups import KVCacheGroup, stage_groups
from paged_ref.kv_int4 import int4_block_bytes, is_int4
from paged_ref.kv_quant import cache_dtype_for, kv_bytes_per_token

__all__ = ["DEFAULT_BLOCK_SIZE", "KVCacheSpec"]


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """One rank's KV cache layout (see module doc).

    ``groups``: the layers this rank caches, by KV cache group (one group of
    every layer unless sliding windows make the model hybrid; a pipeline
    stage keeps each group, with only its own layers). A block id holds one
    group's layers, so a block spans ``cache_layers`` layers.
    ``num_kv_heads``: this rank's (tensor parallelism shards them).
    ``dtype``: the model's; ``kv_cache_dtype`` (vLLM's names) picks what the
    cache stores. ``static_scales``: an 8-bit cache with calibrated scales
    per (layer, kv head), which then stores no per-token scales.
    """

    groups: tuple[KVCacheGroup, ...]
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE
    static_scales: bool = False

    @staticmethod
    def dense(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, **kwargs: object
    ) -> KVCacheSpec:
        """A spec of one group of every layer (no sliding-window groups)."""
        group = KVCacheGroup(tuple(range(num_layers)), None)
        return KVCacheSpec((group,), num_kv_heads, head_dim, dtype, **kwargs)  # type: ignore[arg-type]

    @property
    def cache_dtype(self) -> torch.dtype:
        """What the blocks store (the model's dtype, or an 8- or 4-bit one)."""
        return cache_dtype_for(self.kv_cache_dtype, self.dtype)

    @property
    def num_layers(self) -> int:
        """Layers cached on this rank."""
        return sum(len(g.layers) for g in self.groups)

    @property
    def cache_layers(self) -> int:
        """Layers one block id spans: the fullest group's (the tensors' first dim)."""
        return max(len(g.layers) for g in self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each group's sliding window (None: full attention)."""
        return tuple(g.sliding_window for g in self.groups)

    @property
    def num_null_blocks(self) -> int:
        """Blocks the tensors hold beyond the usable ones: sliding groups
        point freed entries at one null block."""
        return int(any(w is not None for w in self.windows))

    def token_bytes(self, num_layers: int | None = None) -> int:
        """Bytes one token takes over ``num_layers`` layers (default: a
        block's ``cache_layers``), K and V, int8 per-token scales included;
        an int4 token's share of its block's key scales, rounded up."""
        layers = self.cache_layers if num_layers is None else num_layers
        return kv_bytes_per_token(
            layers, self.num_kv_heads, self.head_dim, self.cache_dtype, self.static_scales,
            block_size=self.block_size,
        )  # fmt: skip

    def block_bytes(self, num_layers: int | None = None) -> int:
        """Bytes one block id takes over ``num_layers`` layers (default: ``cache_layers``)."""
        layers = self.cache_layers if num_layers is None else num_layers
        if is_int4(self.cache_dtype):  # key scales are per group of tokens: a whole block's
            return int4_block_bytes(layers, self.num_kv_heads, self.head_dim, self.block_size)
        return self.block_size * kv_bytes_per_token(
            layers, self.num_kv_heads, self.head_dim, self.cache_dtype, self.static_scales
        )

    def blocks_in(self, num_bytes: int) -> int:
        """Whole blocks a byte budget holds."""
        return max(0, num_bytes // self.block_bytes())

    def tokens_in(self, num_blocks: int) -> int:
        """Tokens ``num_blocks`` usable blocks hold when every group holds
        every token (sequences no longer than the windows)."""
        return num_blocks * self.block_size // len(self.groups)

    def blocks_for(self, prompt_len: int, kv_tokens: int) -> int:
        """Blocks one sequence needs at its peak: its prompt in every group
        (taken at admission), or ``kv_tokens`` in full groups and at most a
        window + 1 block in sliding ones, whichever is more."""
        bs = self.block_size
        blocks = -(-kv_tokens // bs)
        peak = sum(blocks if w is None else min(blocks, -(-w // bs) + 1) for w in self.windows)
        return max(peak, len(self.groups) * -(-prompt_len // bs))

    def for_stage(self, layers: range) -> KVCacheSpec:
        """This spec as a pipeline stage holding ``layers`` caches it: every
        group kept (the page tables are shared by all stages), each with its
        layers in ``layers`` only."""
        return replace(self, groups=tuple(stage_groups(list(self.groups), layers)))

    def with_block_size(self, block_size: int) -> KVCacheSpec:
        """The same layout in blocks of ``block_size`` tokens."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        return replace(self, block_size=block_size)

