"""Reference paged attention ops: gather the blocks in use, then SDPA.

These four functions define the semantics of the paged backend (see
docs/contracts.md, "Attention ops"); ``paged_triton.ops`` exports the same
names and is tested against them. Attention is
:func:`torch.nn.functional.scaled_dot_product_attention` over K/V gathered
through the page tables: only the blocks each batch needs are copied, the
gathered ``[batch, tokens, kv_heads, head_dim]`` tensor is read by SDPA as a
strided view (no permute copy) and GQA runs without repeating K/V. Layers
with a soft-cap (which SDPA cannot express) use the float32 oracle
:func:`paged_ref.attention.masked_attention`.

One layer's cache is ``[num_blocks, block_size, kv_heads, head_dim]``.
``memo`` (optional, a dict the caller keeps for one step) lets every layer
reuse what depends only on the step's metadata: gather indices and masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from paged_ref.attention import masked_attention

__all__ = ["copy_blocks", "paged_decode_attention", "paged_prefill_attention", "write_kv"]


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Scatter ``k``/``v`` (``[num_tokens, kv_heads, head_dim]``) into the cache.

    ``slot_mapping[i] = block_id * block_size + offset`` says where token
    ``i`` goes; slot ``-1`` marks padding and is skipped. The cache viewed
    as ``[num_blocks * block_size, kv_heads, head_dim]`` takes one
    ``index_copy_`` per tensor.
    """
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    if slots.numel() and int(slots.min()) < 0:
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    rows = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(rows, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(rows, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


@dataclass(slots=True)
class KeyPlan:
    """Which keys a batch reads, shared by every layer of a step.

    Sequence ``b`` reads key positions ``first[b] .. first[b] + num_keys``
    (whole blocks from ``first_block[b]`` on, or the first ``num_keys``
    positions of a single block); ``visible`` says which of them each query
    row may attend to.
    """

    block_ids: Tensor  # [batch * width] long: blocks to gather, row-major
    width: int  # blocks per sequence (0: single-block slice)
    num_keys: int  # gathered positions per sequence
    key_pos: Tensor  # [batch, num_keys] long: absolute position of each gathered key
    in_range: Tensor  # [batch, num_keys] bool: key holds this sequence's data


def _key_plan(block_tables: Tensor, seq_lens: Tensor, lo: Tensor, cache: Tensor) -> KeyPlan:
    """Gather plan for keys ``[lo[b], seq_lens[b])`` of each sequence.
    Table entries past a sequence's blocks may be anything: they are clamped
    to a valid block and their keys marked out of range."""
    num_blocks, block_size = cache.shape[:2]
    batch = seq_lens.shape[0]
    hi_max = int(seq_lens.max()) if batch else 0
    device = block_tables.device
    if block_tables.shape[1] == 1 and hi_max <= block_size:
        # One block per sequence (the contiguous pool): slice it, keep it whole.
        num_keys = max(hi_max, 1)
        key_pos = torch.arange(num_keys, device=device).expand(batch, num_keys)
        ids = block_tables[:, 0].long().clamp(0, num_blocks - 1)
        width = 0
    else:
        first_block = lo // block_size
        last_block = (seq_lens - 1).clamp(min=0) // block_size
        width = max(int((last_block - first_block).max()) + 1, 1) if batch else 1
        cols = (first_block.unsqueeze(1) + torch.arange(width, device=device)).clamp(
            max=block_tables.shape[1] - 1
        )
        ids = block_tables.long().gather(1, cols).reshape(-1).clamp_(0, num_blocks - 1)
        num_keys = width * block_size
        key_pos = first_block.unsqueeze(1) * block_size + torch.arange(num_keys, device=device)
    in_range = (key_pos >= lo.unsqueeze(1)) & (key_pos < seq_lens.unsqueeze(1))
    return KeyPlan(ids, width, num_keys, key_pos, in_range)


def _gather(cache: Tensor, plan: KeyPlan, batch: int) -> Tensor:
    """``[batch, num_keys, kv_heads, head_dim]`` copy of the planned keys, zero
    where a key is not this sequence's: a reused block may hold stale values,
    even NaN, and SDPA would let ``0 * NaN`` through."""
    if plan.width == 0:
        out = cache[:, : plan.num_keys].index_select(0, plan.block_ids)
    else:
        out = cache.index_select(0, plan.block_ids).view(batch, plan.num_keys, *cache.shape[2:])
    if out.dtype != torch.float32:
        out = out.float()  # float32 softmax and products, as the contract says
    return out.masked_fill_(~plan.in_range[:, :, None, None], 0.0)


def _memo_get(memo: dict[Any, Any] | None, key: tuple[Any, ...], build: Any) -> Any:
    """``build()``, computed once per step when the caller keeps a ``memo``."""
    if memo is None:
        return build()
    value = memo.get(key)
    if value is None:
        value = memo[key] = build()
    return value


def _attend(
    q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float, softcap: float | None
) -> Tensor:
    """``q [B, H, Lq, D]`` over ``k``/``v`` ``[B, L, KVH, D]`` where ``visible``
    (``[B, Lq, L]``) allows; float32 out."""
    if softcap:
        return masked_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), visible, scale, softcap
        ).float()
    return F.scaled_dot_product_attention(
        q.float(),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=visible.unsqueeze(1),
        scale=scale,
        enable_gqa=True,
    )


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    memo: dict[Any, Any] | None = None,
) -> Tensor:
    """One query per sequence (``q``: ``[batch, heads, head_dim]``) at position
    ``seq_lens[b] - 1`` over its paged context; ``seq_lens`` includes the new
    token and 0 gives zeros. Returns ``[batch, heads, head_dim]`` in ``q.dtype``.
    Only the blocks inside each query's window are gathered.
    """
    batch = q.shape[0]
    if batch == 0:
        return q.new_zeros(q.shape)

    def plan() -> tuple[KeyPlan, Tensor]:
        lens = seq_lens.to(device=q.device, dtype=torch.long)
        if sliding_window is None:
            lo = torch.zeros_like(lens)
        else:  # keys (pos - window, pos]; a window of 0 sees nothing
            lo = (lens - sliding_window).clamp(min=0).minimum(lens)
        kp = _key_plan(block_tables.to(q.device), lens, lo, k_cache)
        return kp, kp.in_range.unsqueeze(1)  # visible: [B, 1, L]

    kp, visible = _memo_get(memo, ("decode", sliding_window), plan)
    k, v = _gather(k_cache, kp, batch), _gather(v_cache, kp, batch)
    out = _attend(q.unsqueeze(2), k, v, visible, scale, softcap)
    return out.squeeze(2).to(q.dtype)


def paged_prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    memo: dict[Any, Any] | None = None,
) -> Tensor:
    """Packed (varlen) queries over cached + new context, causal per sequence.

    ``q``: ``[total_q, heads, head_dim]``; sequence ``b`` owns rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, and its query ``i`` sits at
    position ``seq_lens[b] - q_len_b + i``. The K/V of the new tokens must
    already be in the cache (``write_kv`` first). Returns
    ``[total_q, heads, head_dim]`` in ``q.dtype``. Sequences are padded to
    the longest query run for one SDPA call; padding never reaches ``q``'s rows.
    """
    total_q, heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    if total_q == 0 or batch == 0:
        return q.new_zeros(q.shape)

    def plan() -> tuple[KeyPlan, Tensor, Tensor, Tensor]:
        device = q.device
        cu = cu_seqlens_q.to(device=device, dtype=torch.long)
        lens = seq_lens.to(device=device, dtype=torch.long)
        q_lens = cu[1:] - cu[:-1]
        max_q = int(q_lens.max())
        seq_of_row = torch.repeat_interleave(torch.arange(batch, device=device), q_lens)
        row_in_seq = torch.arange(total_q, device=device) - cu[:-1][seq_of_row]
        first_q = lens - q_lens
        lo = torch.zeros_like(lens) if sliding_window is None else first_q - sliding_window + 1
        kp = _key_plan(block_tables.to(device), lens, lo.clamp(min=0), k_cache)
        q_pos = first_q.unsqueeze(1) + torch.arange(max_q, device=device)  # [B, max_q]
        kpos = kp.key_pos.unsqueeze(1)  # [B, 1, L]
        visible = kp.in_range.unsqueeze(1) & (kpos <= q_pos.unsqueeze(2))
        if sliding_window is not None:
            visible &= kpos > q_pos.unsqueeze(2) - sliding_window
        return kp, visible, seq_of_row, row_in_seq

    kp, visible, seq_of_row, row_in_seq = _memo_get(
        memo, ("prefill", sliding_window), plan
    )
    max_q = visible.shape[1]
    q_padded = q.new_zeros(batch, max_q, heads, head_dim)
    q_padded[seq_of_row, row_in_seq] = q
    k, v = _gather(k_cache, kp, batch), _gather(v_cache, kp, batch)
    out = _attend(q_padded.transpose(1, 2), k, v, visible, scale, softcap)
    return out.transpose(1, 2)[seq_of_row, row_in_seq].to(q.dtype)


def gather_context(cache: Tensor, block_tables: Tensor, seq_lens: Tensor) -> Tensor:
    """Each sequence's cached K or V, ``[batch, kv_heads, max_len, head_dim]``
    (position ``p`` at index ``p``; zeros past a sequence's length). For
    views' ``update`` and tests; attention gathers through its own plan."""
    lens = seq_lens.to(device=cache.device, dtype=torch.long)
    kp = _key_plan(block_tables.to(cache.device), lens, torch.zeros_like(lens), cache)
    out = _gather(cache, kp, lens.shape[0]).to(cache.dtype)
    return out[:, : max(int(lens.max()), 0) if lens.numel() else 0].transpose(1, 2)


def copy_blocks(k_caches: Tensor, v_caches: Tensor, src_to_dst: Tensor) -> None:
    """Copy whole blocks ``src -> dst`` in every layer (copy-on-write).

    ``k_caches``: ``[layers, num_blocks, block_size, kv_heads, head_dim]``;
    ``src_to_dst``: ``[n, 2]`` int64. All sources are read before any
    destination is written.
    """
    if src_to_dst.numel() == 0:
        return
    pairs = src_to_dst.to(device=k_caches.device, dtype=torch.long).view(-1, 2)
    src, dst = pairs[:, 0], pairs[:, 1]
    k_caches[:, dst] = k_caches[:, src]
    v_caches[:, dst] = v_caches[:, src]
