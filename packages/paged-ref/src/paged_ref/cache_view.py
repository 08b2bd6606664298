"""The cache view: one flat forward pass over some of a pool's sequences.

Model code sees only this (``AttentionViewProtocol``). A view covers
``seq_ids``; seq_id ``i`` brings ``new_lens[i]`` consecutive tokens of the flat
batch, starting at its cached length ``starts[i]``. Both pools use this one
class: the paged pool hands it page tables, the contiguous pool one
"block" of ``max_model_len`` tokens per seq_id, and every layer then costs one
call of the pool's attention backend (``paged_core.attention_backend``),
which writes the layer's K/V and attends.

A view's metadata is complete before the forward pass: the pool already
reserved every token (the ``CachePoolProtocol`` views, ``seed_views``, reserve
before they build one). Nothing is committed until ``advance()`` (or the
engine's ``mark_computed``): a forward pass that raises leaves the pool as
it was, apart from KV written where no one reads it yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from paged_core.attention_backend import AttentionBackend
from paged_ref.attention_metadata import AttentionMetadata
from paged_ref.kv_quant import HEAD_SCALE_DTYPE, scale_keywords
from paged_ref.ops import gather_context


class ViewPool(Protocol):
    """What a view needs from the cache's tensors (``KVCacheTensors``): ``k_cache``/``v_cache``
    (``[cache_layers, num_blocks, block_size, kv_heads, head_dim]``), the int8
    scales beside them (``[cache_layers, num_blocks, block_size, kv_heads]``,
    None for other dtypes), the static scales of an 8-bit cache with
    calculated scales (``[layers, kv_heads]`` float32, keyed by layer index,
    else None), the ``ops`` module that writes and attends, and where each
    layer lives (``locate_layer``: its KV cache group, its cache layer,
    the group's sliding window)."""

    @property
    def k_cache(self) -> Tensor: ...

    @property
    def v_cache(self) -> Tensor: ...

    @property
    def k_scales(self) -> Tensor | None: ...

    @property
    def v_scales(self) -> Tensor | None: ...

    @property
    def k_head_scales(self) -> Tensor | None: ...

    @property
    def v_head_scales(self) -> Tensor | None: ...

    @property
    def backend(self) -> AttentionBackend: ...

    def is_paged(self) -> bool: ...

    def locate_layer(self, layer_idx: int) -> tuple[int, int, int | None]: ...


class Committer(Protocol):
    """Where a view's ``advance`` commits (the scheduler's side of a pool)."""

    def mark_computed(self, seq_id: int, num_tokens: int) -> None: ...


def static_scales(cache: Tensor, scales: Tensor, name: str, num_layers: int) -> Tensor:
    """``scales`` (``[layers, kv_heads]``, the calibrated K or V scales) as the
    pool keeps them: float32 on the cache's device, each layer's row starting
    16 bytes after the previous one's at least (rows padded to 4 floats), so
    every layer's ``[kv_heads]`` slice has the alignment the Triton kernels
    were specialised (and warmed up) for."""
    layers, kv_heads = num_layers, cache.shape[-2]
    if tuple(scales.shape) != (layers, kv_heads):
        raise ValueError(
            f"static {name} scales must be [layers, kv_heads] = [{layers}, {kv_heads}], "
            f"got {tuple(scales.shape)}"
        )
    padded = torch.ones(layers, -(-kv_heads // 4) * 4, dtype=HEAD_SCALE_DTYPE, device=cache.device)
    padded[:, :kv_heads] = scales.to(device=cache.device, dtype=HEAD_SCALE_DTYPE)
    return padded[:, :kv_heads]


class CacheView:
    """A flat forward pass over ``seq_ids`` of a pool (see module doc), its
    metadata ``meta`` built before the pass."""

    def __init__(
        self,
        tensors: ViewPool,
        meta: AttentionMetadata,
        seq_ids: Sequence[int] = (),
        committer: Committer | None = None,
    ) -> None:
        self.tensors = tensors
        self.meta = meta
        self.seq_ids = list(seq_ids)
        self.committer = committer

    @classmethod
    def over(cls, tensors: ViewPool, meta: AttentionMetadata) -> CacheView:
        """A view of a worker's step (or of the static buffers a CUDA graph
        reads): it covers no seq_ids of its own, so ``advance`` commits
        nothing; the scheduler's side commits."""
        return cls(tensors, meta)

    # -- KVCacheProtocol ---------------------------------------------------------
    @property
    def seq_len(self) -> int:
        """Tokens cached before this pass (the max over the view's seq_ids)."""
        return max(self.meta.starts, default=0)

    def is_paged(self) -> bool:
        return self.tensors.is_paged()

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k``/``v`` (``[num_tokens, kv_heads, head_dim]``, the view's
        tokens in seq_id order) and return each seq_id's whole context,
        ``[num_seqs, kv_heads, max_len, head_dim]`` (position ``p`` at index
        ``p``; zeros past a seq_id's length)."""
        meta, cache_layer, s = self._write(layer_idx, k, v)
        return (
            gather_context(self.tensors.k_cache[cache_layer], meta.block_tables, meta.seq_lens,
                           s.get("k_scales"), s.get("k_head_scales")),
            gather_context(self.tensors.v_cache[cache_layer], meta.block_tables, meta.seq_lens,
                           s.get("v_scales"), s.get("v_head_scales"), is_key=False),
        )  # fmt: skip

    def advance(self, n: int | None = None) -> None:
        """Commit this pass: each seq_id now holds ``starts[i] + new_lens[i]``
        tokens (``n`` is not needed: the view knows its counts)."""
        if self.committer is None:
            return
        for seq_id, start, new in zip(self.seq_ids, self.meta.starts, self.meta.new_lens, strict=True):
            self.committer.mark_computed(seq_id, start + new)

    # -- AttentionViewProtocol ---------------------------------------------------
    def attend(
        self,
        layer_idx: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> Tensor:
        """The pool's backend writes ``k``/``v`` and attends ``q``
        (``[num_tokens, heads, head_dim]``; returns the same shape).
        A layer in a sliding KV cache group must attend with that window:
        its group frees blocks a wider window would still read."""
        where = self.tensors.locate_layer(layer_idx)
        group, _, window = where
        if window is not None and sliding_window != window:
            raise ValueError(
                f"layer {layer_idx} attends with sliding_window={sliding_window} but its KV "
                f"cache group {group} frees blocks outside a window of {window} tokens; "
                "build the pool's groups from the model's layer windows (kv_cache_groups)"
            )
        meta, cache_layer, scales = self._layer(layer_idx, k, where)
        return self.tensors.backend.attend(  # type: ignore[no-any-return]
            self.tensors.k_cache[cache_layer], self.tensors.v_cache[cache_layer], meta, q, k, v,
            scale=scale, sliding_window=sliding_window, softcap=softcap or None,  # 0 is off, as in vLLM
            scales=scales,
        )  # fmt: skip

    # -- internals ---------------------------------------------------------------
    def _write(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[AttentionMetadata, int, dict[str, Tensor]]:
        """Write the layer's new K/V; returns what ``_layer`` does."""
        meta, cache_layer, scales = self._layer(layer_idx, k)
        self.tensors.backend.write_kv(
            self.tensors.k_cache[cache_layer], self.tensors.v_cache[cache_layer], k, v, meta.slot_mapping, **scales
        )
        return meta, cache_layer, scales

    def _layer(
        self, layer_idx: int, k: Tensor, where: tuple[int, int, int | None] | None = None
    ) -> tuple[AttentionMetadata, int, dict[str, Tensor]]:
        """The layer's group metadata, cache layer and scales as the ops'
        keywords (``where``: ``locate_layer``'s answer, if the caller has it),
        after checking ``k`` brings the view's tokens."""
        group, cache_layer, _ = where if where is not None else self.tensors.locate_layer(layer_idx)
        meta = self.meta.for_group(group)
        if k.shape[0] != meta.num_tokens:
            raise ValueError(
                f"k/v hold {k.shape[0]} tokens but this view's seq_ids bring {meta.num_tokens}"
            )
        return meta, cache_layer, self._scales(layer_idx, cache_layer)

    def _scales(self, layer_idx: int, cache_layer: int) -> dict[str, Tensor]:
        """The layer's scales as the ops' keywords: int8 per-token scales (at
        the layer's cache layer), or static per-head ones (indexed by
        layer); none for other dtypes (so an ops module written before 8-bit
        caches still serves them)."""
        pool = self.tensors
        k_scales, v_scales = pool.k_scales, pool.v_scales
        k_head, v_head = pool.k_head_scales, pool.v_head_scales
        return scale_keywords(
            None if k_scales is None else k_scales[cache_layer],
            None if v_scales is None else v_scales[cache_layer],
            None if k_head is None else k_head[layer_idx],
            None if v_head is None else v_head[layer_idx],
        )

