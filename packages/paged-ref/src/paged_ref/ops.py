"""Reference paged attention ops: gather the blocks in use, then SDPA.

These four functions define the semantics of the paged backend (see
docs/contracts.md, "Attention ops"); ``paged_triton.ops`` exports the same
names and is tested against them. Attention is
:func:`torch.nn.functional.scaled_dot_product_attention` over K/V gathered
through the page tables (``paged_ref.gather``: only the blocks in use, a
cache-sized chunk of sequences at a time, into one scratch buffer); the
gathered ``[batch, tokens, kv_heads, head_dim]`` tensor is read by SDPA as a
strided view (no permute copy) and GQA runs without repeating K/V. Layers
with a soft-cap (which SDPA cannot express) use the float32 oracle
:func:`paged_ref.attention.masked_attention`.

One layer's cache is ``[num_blocks, block_size, kv_heads, head_dim]``.
``memo`` (optional, a dict the caller keeps for one step) lets every layer
reuse what depends only on the step's metadata (gather indices, masks) and
one float32 scratch buffer that every chunk of every layer gathers into.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from paged_ref.attention import masked_attention
from paged_ref.gather import GatherChunk, chunk_numel, gather, plan_chunks
from paged_ref.kv_int4 import is_int4, write_keys, write_values
from paged_ref.kv_quant import (
    as_bits,
    check_scales,
    is_quantized,
    logical_shape,
    quantize,
    quantize_static,
)
from paged_ref.op_args import CopyBlocksArgs, DecodeArgs, PrefillArgs, WriteKVArgs, op

__all__ = ["copy_blocks", "paged_decode_attention", "paged_prefill_attention", "write_kv"]


@op(WriteKVArgs)
def write_kv(a: WriteKVArgs) -> None:
    """Scatter ``k``/``v`` (``[num_tokens, kv_heads, head_dim]``) into the cache.

    ``slot_mapping[i] = block_id * block_size + offset`` says where token
    ``i`` goes; slot ``-1`` marks padding and is skipped. The cache viewed
    as ``[num_blocks * block_size, kv_heads, head_dim]`` takes one
    ``index_copy_`` per tensor. An 8-bit cache stores ``kv_quant.quantize``'s
    codes, and an int8 one its per-token-per-head scales in ``k_scales`` /
    ``v_scales`` (``[num_blocks, block_size, kv_heads]``); with static
    ``k_head_scales``/``v_head_scales`` (``[kv_heads]`` float32, this layer's)
    it stores ``kv_quant.quantize_static``'s codes and no per-token scales.
    An int4 cache (``kv_int4``: codes ``[..., head_dim // 2]``) takes its
    block scales in ``k_scales``/``v_scales``: values per token, and every
    key group a new token joins re-quantized (``kv_int4.write_keys``).
    """
    k_cache, v_cache, k, v = a.k_cache, a.v_cache, a.k, a.v
    check_scales(k_cache, a.k_scales, "k_scales", a.k_head_scales)
    check_scales(v_cache, a.v_scales, "v_scales", a.v_head_scales)
    slots = a.slot_mapping.to(device=k_cache.device, dtype=torch.long)
    if slots.numel() and int(slots.min()) < 0:
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    if is_int4(k_cache.dtype):  # keys per channel (group re-quantized), values per token
        write_keys(k_cache, a.k_scales, k, slots)  # type: ignore[arg-type]
        write_values(v_cache, a.v_scales, v, slots)  # type: ignore[arg-type]
        return
    rows = k_cache.shape[0] * k_cache.shape[1]
    for cache, scales, head_scales, new in (
        (k_cache, a.k_scales, a.k_head_scales, k), (v_cache, a.v_scales, a.v_head_scales, v)
    ):
        if head_scales is not None:
            codes, new_scales = quantize_static(new, cache.dtype, head_scales), None
        else:
            codes, new_scales = quantize(new, cache.dtype)
        as_bits(cache).view(rows, *cache.shape[2:]).index_copy_(0, slots, as_bits(codes))
        if scales is not None and new_scales is not None:
            scales.view(rows, -1).index_copy_(0, slots, new_scales)


def _memo_get(memo: dict[Any, Any] | None, key: tuple[Any, ...], build: Any) -> Any:
    """``build()``, computed once per step when the caller keeps a ``memo``."""
    if memo is None:
        return build()
    value = memo.get(key)
    if value is None:
        value = memo[key] = build()
    return value


def _scratch_kv(
    memo: dict[Any, Any] | None, cache: Tensor, chunk: GatherChunk, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """Where ``gather`` copies the chunk's K and V: two halves of one
    ``dtype`` buffer kept in ``memo`` for the whole step (grown when a chunk
    needs more), so no layer allocates; without a memo, new ones."""
    if memo is None:
        memo = {}
    numel = chunk_numel(cache, chunk)
    buf = memo.get(("scratch", dtype))
    if buf is None or buf.numel() < 2 * numel:
        buf = memo[("scratch", dtype)] = torch.empty(2 * numel, dtype=dtype, device=cache.device)
    return buf[:numel], buf[numel : 2 * numel]


def _additive(visible: Tensor) -> Tensor:
    """A bool mask as SDPA's float one: 0 where visible, -inf elsewhere (made
    once per step; SDPA would convert a bool mask in every layer)."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, float("-inf"))


def _attend(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float | None
) -> Tensor:
    """``q [B, H, Lq, D]`` over ``k``/``v`` ``[B, L, KVH, D]``; ``mask`` is
    ``[B, 1, G * Lq, L]`` float, 0 where visible and -inf elsewhere (see
    ``_gqa_mask``). Returns ``[B, H, Lq, D]`` in ``k``'s dtype (float32 but
    for ``prefill_attention``'s 16-bit one).

    GQA without copying K/V: the ``G`` query heads that share a kv head are
    folded into the query axis, so SDPA sees ``KVH`` heads of ``G * Lq``
    queries each (on CPU this beats ``enable_gqa``'s path by ~2x)."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads = k.shape[2]
    if heads % kv_heads:
        raise ValueError(
            f"query heads ({heads}) must be a multiple of kv heads ({kv_heads}) for GQA/MQA"
        )
    if softcap:
        visible = mask[:, 0, :q_len] == 0  # the first folded head's rows: [B, Lq, L]
        return masked_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), visible, scale, softcap
        ).float()
    out = F.scaled_dot_product_attention(
        q.to(k.dtype).reshape(batch, kv_heads, -1, head_dim),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
    )
    return out.reshape(batch, heads, q_len, head_dim)  # CUDA's SDPA may return it non-contiguous


def _gqa_mask(visible: Tensor, q_per_kv: int) -> Tensor:
    """``visible [B, Lq, L]`` repeated for the ``q_per_kv`` query heads of a
    kv head folded into the query axis, as an additive mask: ``[B, 1, q_per_kv * Lq, L]``."""
    batch, q_len, num_keys = visible.shape
    mask = _additive(visible).unsqueeze(1)
    if q_len == 1:
        return mask  # broadcasts over the folded heads
    return mask.expand(batch, q_per_kv, q_len, num_keys).reshape(batch, 1, q_per_kv * q_len, num_keys)


@op(DecodeArgs)
def paged_decode_attention(a: DecodeArgs) -> Tensor:
    """One query per sequence (``q``: ``[batch, heads, head_dim]``) at position
    ``seq_lens[b] - 1`` over its paged context; ``seq_lens`` includes the new
    token and 0 gives zeros. Returns ``[batch, heads, head_dim]`` in ``q.dtype``.
    Only the blocks inside each query's window are gathered. An 8-bit cache
    is dequantized as it is gathered (int8 with ``k_scales``/``v_scales``;
    static scales: ``k_head_scales``/``v_head_scales``).
    """
    q, k_cache, v_cache, window, memo = a.q, a.k_cache, a.v_cache, a.sliding_window, a.memo
    if q.shape[0] == 0:
        return q.new_zeros(q.shape)

    def plan() -> list[tuple[GatherChunk, Tensor]]:
        lens = a.seq_lens.to(device=q.device, dtype=torch.long)
        if window is None:
            lo = torch.zeros_like(lens)
        else:  # keys (pos - window, pos]; a window of 0 sees nothing
            lo = (lens - window).clamp(min=0).minimum(lens)
        chunks = plan_chunks(a.block_tables.to(q.device), lens, lo, k_cache)
        return [(c, _gqa_mask(c.in_range.unsqueeze(1), 1)) for c in chunks]

    out = torch.empty_like(q)
    for chunk, mask in _memo_get(memo, ("decode", window), plan):
        k_out, v_out = _scratch_kv(memo, k_cache, chunk)
        k = gather(k_cache, chunk, a.k_scales, a.k_head_scales, k_out)
        v = gather(v_cache, chunk, a.v_scales, a.v_head_scales, v_out, is_key=False)
        o = _attend(q[chunk.seqs].unsqueeze(2), k, v, mask, a.scale, a.softcap)
        out[chunk.seqs] = o.squeeze(2)
    return out


@dataclass(slots=True)
class _PrefillChunk:
    """A gather chunk plus where its sequences' queries sit in the packed rows."""

    keys: GatherChunk
    mask: Tensor  # [n, 1, G * max_q, num_keys]
    rows: slice  # packed query rows of these sequences
    seq_of_row: Tensor  # [rows] long, chunk-relative sequence of each row
    row_in_seq: Tensor  # [rows] long
    max_q: int


@op(PrefillArgs)
def paged_prefill_attention(a: PrefillArgs) -> Tensor:
    """Packed (varlen) queries over cached + new context, causal per sequence.

    ``q``: ``[total_q, heads, head_dim]``; sequence ``b`` owns rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, and its query ``i`` sits at
    position ``seq_lens[b] - q_len_b + i``. The K/V of the new tokens must
    already be in the cache (``write_kv`` first). Returns
    ``[total_q, heads, head_dim]`` in ``q.dtype``. A chunk's sequences are
    padded to its longest query run for one SDPA call; padding rows are dropped.
    8-bit caches are read as for ``paged_decode_attention``.
    """
    return prefill_attention(a, torch.float32)


def prefill_attention(a: PrefillArgs, compute_dtype: torch.dtype) -> Tensor:
    """``paged_prefill_attention`` with its products in ``compute_dtype``
    (the reference op's is float32; a cache's own 16-bit dtype also works,
    SDPA's CPU kernel accumulating and taking the softmax in float32 either
    way). A CPU server's 16-bit prefill takes ``cpu.cpu_decode.prefill_by_sequence``
    instead: one SDPA call per sequence, without this chunked gather's
    padding and step-wide mask."""
    q, k_cache, v_cache, window, memo = a.q, a.k_cache, a.v_cache, a.sliding_window, a.memo
    total_q, heads, head_dim = q.shape
    batch = a.seq_lens.shape[0]
    if total_q == 0 or batch == 0:
        return q.new_zeros(q.shape)
    q_per_kv = heads // max(k_cache.shape[2], 1)

    def plan() -> list[_PrefillChunk]:
        device = q.device
        cu = a.cu_seqlens_q.to(device=device, dtype=torch.long)
        lens = a.seq_lens.to(device=device, dtype=torch.long)
        q_lens = cu[1:] - cu[:-1]
        first_q = lens - q_lens
        lo = torch.zeros_like(lens) if window is None else first_q - window + 1
        out = []
        for keys in plan_chunks(a.block_tables.to(device), lens, lo.clamp(min=0), k_cache):
            s = keys.seqs
            n_q = q_lens[s]
            max_q = max(int(n_q.max()), 1)
            seq_of_row = torch.repeat_interleave(torch.arange(keys.size, device=device), n_q)
            row_in_seq = torch.arange(int(n_q.sum()), device=device) - (cu[s] - cu[s.start])[
                seq_of_row
            ]
            q_pos = first_q[s].unsqueeze(1) + torch.arange(max_q, device=device)  # [n, max_q]
            kpos = keys.key_pos.unsqueeze(1)  # [n, 1, L]
            visible = keys.in_range.unsqueeze(1) & (kpos <= q_pos.unsqueeze(2))
            if window is not None:
                visible &= kpos > q_pos.unsqueeze(2) - window
            rows = slice(int(cu[s.start]), int(cu[s.stop]))
            out.append(
                _PrefillChunk(keys, _gqa_mask(visible, q_per_kv), rows, seq_of_row, row_in_seq, max_q)
            )
        return out

    out = torch.empty_like(q)
    for c in _memo_get(memo, ("prefill", window), plan):
        q_padded = q.new_zeros(c.keys.size, heads, c.max_q, head_dim)
        q_padded[c.seq_of_row, :, c.row_in_seq] = q[c.rows]
        k_out, v_out = _scratch_kv(memo, k_cache, c.keys, compute_dtype)
        k = gather(k_cache, c.keys, a.k_scales, a.k_head_scales, k_out)
        v = gather(v_cache, c.keys, a.v_scales, a.v_head_scales, v_out, is_key=False)
        o = _attend(q_padded, k, v, c.mask, a.scale, a.softcap)
        out[c.rows] = o[c.seq_of_row, :, c.row_in_seq]
    return out


def gather_context(
    cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scales: Tensor | None = None,
    head_scales: Tensor | None = None,
    *,
    is_key: bool = True,
) -> Tensor:
    """Each sequence's cached K or V, ``[batch, kv_heads, max_len, head_dim]``
    (position ``p`` at index ``p``; zeros past a sequence's length), in the
    cache's dtype, or dequantized to float32 for an 8- or 4-bit cache
    (``is_key``: which of an int4 cache's two schemes). For views'
    ``update`` and tests; attention gathers chunk by chunk."""
    lens = seq_lens.to(device=cache.device, dtype=torch.long)
    max_len = int(lens.max()) if lens.numel() else 0
    dtype = torch.float32 if is_quantized(cache.dtype) else cache.dtype
    shape = logical_shape(cache)[2:]
    out = torch.zeros(lens.shape[0], max_len, *shape, dtype=dtype, device=cache.device)
    chunks = plan_chunks(block_tables.to(cache.device), lens, torch.zeros_like(lens), cache)
    for chunk in chunks:
        part = gather(cache, chunk, scales, head_scales, is_key=is_key)[:, :max_len]
        out[chunk.seqs, : part.shape[1]] = part.to(dtype)
    return out.transpose(1, 2)


@op(CopyBlocksArgs)
def copy_blocks(a: CopyBlocksArgs) -> None:
    """Copy whole blocks ``src -> dst`` in every layer (copy-on-write).

    ``k_caches``: ``[layers, num_blocks, block_size, kv_heads, head_dim]``;
    ``src_to_dst``: host pairs, a list of ``(src, dst)`` or an int64 tensor
    ``[n, 2]``, moved to the caches' device in one copy. All sources are
    read before any destination is written. An int8 cache's per-token scales
    (``[layers, num_blocks, block_size, kv_heads]``) are copied with it; a
    cache with static scales (per layer, not per block) passes none.
    """
    if a.k_scales is not None or a.v_scales is not None:
        check_scales(a.k_caches, a.k_scales, "k_scales")
        check_scales(a.v_caches, a.v_scales, "v_scales")
    pairs = torch.as_tensor(a.src_to_dst, dtype=torch.long).reshape(-1, 2)
    if pairs.shape[0] == 0:
        return
    pairs = pairs.to(device=a.k_caches.device, non_blocking=True)
    src, dst = pairs[:, 0], pairs[:, 1]
    for tensor in (a.k_caches, a.v_caches, a.k_scales, a.v_scales):
        if tensor is not None:
            bits = as_bits(tensor)
            bits[:, dst] = bits[:, src]
