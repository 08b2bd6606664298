"""The worker's side of a KV cache: its tensors, the backend that reads and writes them, and step views.

``KVCacheTensors`` holds ``k_cache``/``v_cache`` (``[cache_layers, blocks,
block_size, kv_heads, head_dim]``; a contiguous cache is the same with one
block of ``max_model_len`` tokens per sequence), the scales of an 8- or
4-bit cache, the attention ``backend`` (``paged_core.attention_backend``), and where each model layer
lives (its KV cache group and cache layer). It knows nothing of sequences:
each step arrives as a ``StepLayout`` from the scheduler's side (page
tables, positions, block copies), and ``view`` turns it into the step's
``CacheView``, copies made first. Every rank's worker holds one, built from
the same ``KVCacheSpec`` and block count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from paged_core.attention_backend import AttentionBackend
from paged_core.kv_cache_groups import KVCacheGroup, cache_layers
from paged_ref.attention_metadata import AttentionMetadata, build_metadata
from paged_ref.cache_view import CacheView, static_scales
from paged_ref.kv_quant import (
    check_scales,
    logical_shape,
    new_scales,
    scale_keywords,
    storage_shape,
)
from paged_ref.kv_spec import KVCacheSpec
from paged_ref.ops_backend import OpsBackend
from paged_ref.ref_backend import RefBackend
from paged_ref.step_layout import StepLayout


def as_backend(ops: AttentionBackend | Any | None) -> AttentionBackend:
    """The attention backend a cache runs: ``ops`` if it is one; the
    reference for None; a bare ops namespace (a test's spy) as ``OpsBackend``."""
    if ops is None:
        return RefBackend()
    if isinstance(ops, AttentionBackend):
        return ops
    return OpsBackend(ops)


class KVCacheTensors:
    """A cache's tensors and ops (see module doc); satisfies ``ViewPool``."""

    def __init__(
        self,
        k_cache: Tensor,
        v_cache: Tensor,
        *,
        block_size: int | None = None,
        paged: bool = True,
        ops: AttentionBackend | Any | None = None,
        k_scales: Tensor | None = None,
        v_scales: Tensor | None = None,
        kv_scales: tuple[Tensor, Tensor] | None = None,
        groups: Sequence[KVCacheGroup] | None = None,
    ) -> None:
        """``block_size``: tokens per block (default: the tensors' second
        dim after the blocks); ``kv_scales``: static K and V scales
        ``[layers, kv_heads]`` (``calculate_kv_scales``), kept as float32 on
        the cache's device; ``groups``: the KV cache groups (default one
        group of every cache layer)."""
        if k_cache.shape != v_cache.shape or k_cache.dim() != 5:
            raise ValueError(
                "k_cache and v_cache must both be [layers, blocks, block_size, kv_heads, head_dim], "
                f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
            )
        shape = logical_shape(k_cache)  # an int4 cache packs two head_dim codes per byte
        self.num_cache_layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim = shape
        if block_size is not None and block_size != self.block_size:
            raise ValueError(f"the tensors hold blocks of {self.block_size} tokens, not {block_size}")
        self.groups = list(groups or [KVCacheGroup(tuple(range(self.num_cache_layers)), None)])
        # A pipeline stage's groups may hold fewer layers (``stage_groups``), even none.
        if max(len(g.layers) for g in self.groups) != self.num_cache_layers:
            raise ValueError(
                f"the cache tensors have {self.num_cache_layers} cache layers but the KV cache groups "
                f"hold {[len(g.layers) for g in self.groups]} layers; build the tensors with "
                "one cache layer per layer of the fullest group"
            )
        self.num_layers = sum(len(g.layers) for g in self.groups)
        self._where = cache_layers(self.groups)
        self._paged = paged
        self.k_head_scales: Tensor | None = None
        self.v_head_scales: Tensor | None = None
        if kv_scales is not None:  # indexed by model layer: a pipeline stage's start past 0
            rows = max(self._where) + 1
            self.k_head_scales, self.v_head_scales = (
                static_scales(k_cache, s[:rows], name, rows)
                for s, name in zip(kv_scales, "kv", strict=True)
            )
        check_scales(k_cache, k_scales, "k_scales", None if self.k_head_scales is None else self.k_head_scales[0])
        check_scales(v_cache, v_scales, "v_scales", None if self.v_head_scales is None else self.v_head_scales[0])
        self.k_cache, self.v_cache = k_cache, v_cache
        # int8 (and int4) only: per-token scales beside the codes.
        self.k_scales, self.v_scales = k_scales, v_scales
        self.backend = as_backend(ops)

    @staticmethod
    def allocate(
        spec: KVCacheSpec,
        num_blocks: int,
        device: str | torch.device = "cpu",
        *,
        paged: bool = True,
        ops: AttentionBackend | Any | None = None,
        kv_scales: tuple[Tensor, Tensor] | None = None,
    ) -> KVCacheTensors:
        """Zeroed tensors of ``num_blocks`` blocks (every one, the null block
        included) laid out as ``spec`` says (``device="meta"`` sizes them
        without allocating memory)."""
        if spec.static_scales != (kv_scales is not None):
            raise ValueError("pass kv_scales exactly when the spec says static_scales")
        shape = (spec.cache_layers, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        dtype = spec.cache_dtype
        k_cache = torch.zeros(storage_shape(shape, dtype), dtype=dtype, device=device)
        v_cache = torch.zeros(storage_shape(shape, dtype), dtype=dtype, device=device)
        static = kv_scales is not None
        return KVCacheTensors(
            k_cache, v_cache, paged=paged, ops=ops,
            k_scales=new_scales(k_cache, static, "k_scales"),
            v_scales=new_scales(v_cache, static, "v_scales"),
            kv_scales=kv_scales, groups=spec.groups,
        )  # fmt: skip

    @property
    def ops(self) -> Any:
        """The backend's ops (``write_kv``, ``paged_decode_attention``, ...)."""
        return self.backend.ops

    @property
    def device(self) -> torch.device:
        return self.k_cache.device

    def is_paged(self) -> bool:
        return self._paged

    def locate_layer(self, layer_idx: int) -> tuple[int, int, int | None]:
        """``(group, cache layer, group window)`` of model layer ``layer_idx``."""
        where = self._where.get(layer_idx)
        if where is None:
            raise IndexError(f"layer {layer_idx} is not one of this cache's {self.num_layers} layers")
        group, cache_layer = where
        return group, cache_layer, self.groups[group].sliding_window

    def kv_bytes(self) -> int:
        """Bytes held by the K and V tensors together, per-token scales
        included (static scales, per layer and kv head, are not token storage)."""
        tensors = (self.k_cache, self.v_cache, self.k_scales, self.v_scales)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write,
        forks); an int8 cache's per-token scales move with them."""
        if pairs:
            self.backend.copy_blocks(
                self.k_cache, self.v_cache, list(pairs), **scale_keywords(self.k_scales, self.v_scales)
            )

    def metadata(self, layout: StepLayout) -> AttentionMetadata:
        """The step's attention metadata, once its block copies are made (so
        every block the step reads or writes holds its data)."""
        self.make_copies(layout)
        return self.build(layout)

    def make_copies(self, layout: StepLayout) -> None:
        """The block copies the layout carries, in order (right before its pass)."""
        for pairs in layout.copies:
            self.copy_blocks(pairs)

    def build(self, layout: StepLayout) -> AttentionMetadata:
        """The step's attention metadata alone (it reads no block, so it may be
        built while an earlier step still runs)."""
        return build_metadata(layout.block_tables, layout.starts, layout.new_lens, self.block_size, self.device)

    def view(self, layout: StepLayout) -> CacheView:
        """The step's view: it commits nothing (the scheduler's side does)."""
        return CacheView.over(self, self.metadata(layout))
