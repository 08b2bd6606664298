"""Reference paged attention ops: gather through block tables, then dense attention.

These four functions define the semantics of the paged backend (see
docs/contracts.md, "Attention ops"); ``paged_triton.ops`` exports the same
names and is tested against them. They favour clarity over speed: K/V are
gathered into a padded dense tensor and attended with
:func:`paged_ref.attention.masked_attention` in float32.

One layer's cache is ``[num_blocks, kv_heads, block_size, head_dim]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from paged_ref.attention import context_mask, masked_attention

__all__ = ["copy_blocks", "paged_decode_attention", "paged_prefill_attention", "write_kv"]


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Scatter ``k``/``v`` (``[num_tokens, kv_heads, head_dim]``) into the cache.

    ``slot_mapping[i] = block_id * block_size + offset`` says where token
    ``i`` goes; slot ``-1`` marks padding and is skipped. One vectorized
    index_put per tensor, so a batch of any shape costs one write.
    """
    block_size = k_cache.shape[2]
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    blocks, offsets = slots // block_size, slots % block_size
    # Advanced indices on dims 0 and 2 around a slice: the indexed view is
    # [num_tokens, kv_heads, head_dim], matching k.
    k_cache[blocks, :, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, :, offsets] = v.to(v_cache.dtype)


def gather_context(cache: Tensor, block_tables: Tensor) -> Tensor:
    """A layer's cache read through page tables: ``[batch, kv_heads, max_blocks * block_size, head_dim]``.

    Position ``p`` of sequence ``b`` lands at index ``p``; entries past the
    sequence's length are whatever the referenced blocks hold (callers mask).
    """
    num_blocks, kv_heads, block_size, head_dim = cache.shape
    tables = block_tables.to(device=cache.device, dtype=torch.long).clamp(0, num_blocks - 1)
    batch, max_blocks = tables.shape
    gathered = cache[tables]  # [B, max_blocks, KVH, block_size, D]
    return gathered.permute(0, 2, 1, 3, 4).reshape(
        batch, kv_heads, max_blocks * block_size, head_dim
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
) -> Tensor:
    """One query per sequence (``q``: ``[batch, heads, head_dim]``) at position
    ``seq_lens[b] - 1`` over its paged context; ``seq_lens`` includes the new
    token and 0 gives zeros. Returns ``[batch, heads, head_dim]`` in ``q.dtype``.
    """
    k = gather_context(k_cache, block_tables)
    v = gather_context(v_cache, block_tables)
    lens = seq_lens.to(device=q.device, dtype=torch.long)
    mask = context_mask((lens - 1).unsqueeze(1), lens, k.shape[2], sliding_window)
    out = masked_attention(q.unsqueeze(2), k, v, mask, scale, softcap)
    return out.squeeze(2)


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
) -> Tensor:
    """Packed (varlen) queries over cached + new context, causal per sequence.

    ``q``: ``[total_q, heads, head_dim]``; sequence ``b`` owns rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, and its query ``i`` sits at
    position ``seq_lens[b] - q_len_b + i``. The K/V of the new tokens must
    already be in the cache (``write_kv`` first). Returns
    ``[total_q, heads, head_dim]`` in ``q.dtype``.
    """
    device = q.device
    cu = cu_seqlens_q.to(device=device, dtype=torch.long)
    lens = seq_lens.to(device=device, dtype=torch.long)
    batch = lens.shape[0]
    q_lens = cu[1:] - cu[:-1]
    total_q, heads, head_dim = q.shape
    if total_q == 0 or batch == 0:
        return q.new_zeros(q.shape)
    max_q = int(q_lens.max())

    # Unpack to [B, max_q, H, D] so every sequence shares one dense attention call.
    seq_of_token = torch.repeat_interleave(torch.arange(batch, device=device), q_lens)
    idx_in_seq = torch.arange(total_q, device=device) - cu[:-1][seq_of_token]
    q_padded = q.new_zeros(batch, max_q, heads, head_dim)
    q_padded[seq_of_token, idx_in_seq] = q

    i = torch.arange(max_q, device=device).unsqueeze(0)
    positions = (lens - q_lens).unsqueeze(1) + i
    q_valid = i < q_lens.unsqueeze(1)

    k = gather_context(k_cache, block_tables)
    v = gather_context(v_cache, block_tables)
    mask = context_mask(positions, lens, k.shape[2], sliding_window, q_valid)
    out = masked_attention(q_padded.transpose(1, 2), k, v, mask, scale, softcap)
    return out.transpose(1, 2)[seq_of_token, idx_in_seq]


def copy_blocks(k_caches: Tensor, v_caches: Tensor, src_to_dst: Tensor) -> None:
    """Copy whole blocks ``src -> dst`` in every layer (copy-on-write).

    ``k_caches``: ``[layers, num_blocks, kv_heads, block_size, head_dim]``;
    ``src_to_dst``: ``[n, 2]`` int64. All sources are read before any
    destination is written.
    """
    if src_to_dst.numel() == 0:
        return
    pairs = src_to_dst.to(device=k_caches.device, dtype=torch.long).view(-1, 2)
    src, dst = pairs[:, 0], pairs[:, 1]
    k_caches[:, dst] = k_caches[:, src]
    v_caches[:, dst] = v_caches[:, src]
