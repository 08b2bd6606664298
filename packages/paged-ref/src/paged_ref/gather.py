"""Reading a batch's keys and values out of a paged cache, a cache-sized chunk at a time.

The reference attention copies each sequence's context into a dense tensor
and hands that to SDPA (PyTorch has no batched product that reads through a
page table). On a CPU, attention over a long context is bound by memory
traffic, and a dense copy of the whole batch does not fit any cache: SDPA
then reads back from DRAM what the gather just wrote. So the batch is cut
into chunks of sequences whose gathered K+V stay under ``CHUNK_BYTES``; each
chunk is gathered and attended while it is still in cache.

The copy goes into a scratch buffer the caller reuses for every chunk of
every layer (``out``), not a new tensor: a fresh megabyte-sized tensor per
chunk costs page faults and cold cache lines.

Each chunk gathers only the blocks its sequences use, from the first block
its queries can see (a sliding window skips older blocks) to its last one;
positions that are not the sequence's own (the tail of its last block,
padding up to the chunk's longest sequence) are zeroed after the copy,
because a reused block may hold stale values, even NaN, and ``0 * NaN``
would leak through attention.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from paged_ref.kv_int4 import gather_int4, is_int4
from paged_ref.kv_quant import FP8_MAX, as_bits, logical_shape

CHUNK_BYTES = 1 << 20  # gathered K+V per chunk: fits the L2 of a small CPU


@dataclass(slots=True)
class GatherChunk:
    """Sequences ``seqs`` of a batch and the keys they read.

    Sequence ``b`` reads ``num_keys`` positions from ``key_pos[b, 0]`` on:
    whole blocks ``block_ids`` (``width`` per sequence), or, when every
    sequence has a single block (the contiguous pool), the first ``num_keys``
    positions of block ``block_ids[b]`` (``width == 0``).
    """

    seqs: slice
    block_ids: Tensor  # [n * width] (or [n]) long
    width: int
    num_keys: int
    key_pos: Tensor  # [n, num_keys] long: absolute position of each gathered key
    in_range: Tensor  # [n, num_keys] bool: position holds this sequence's own data
    stale_rows: Tensor  # flat indices into [n * num_keys] of the other positions

    @property
    def size(self) -> int:
        return self.seqs.stop - self.seqs.start


def plan_chunks(
    block_tables: Tensor,
    seq_lens: Tensor,
    lo: Tensor,
    cache: Tensor,
    chunk_bytes: int | None = None,
) -> list[GatherChunk]:
    """Chunks covering keys ``[lo[b], seq_lens[b])`` of every sequence ``b``.
    Table entries past a sequence's blocks may be anything: they are
    clamped to a valid block and their positions marked out of range."""
    budget = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    num_blocks, block_size = cache.shape[:2]
    batch = seq_lens.shape[0]
    single = block_tables.shape[1] == 1 and (batch == 0 or int(seq_lens.max()) <= block_size)
    first_block = lo // block_size
    last_block = (seq_lens - 1).clamp(min=0) // block_size
    if single:
        spans = seq_lens.clamp(min=1).tolist()
    else:
        spans = ((last_block - first_block).clamp(min=0) + 1).mul(block_size).tolist()
    row_bytes = 2 * math.prod(logical_shape(cache)[2:]) * 4  # K and V of one position, float32
    chunks: list[GatherChunk] = []
    start = 0
    while start < batch:
        end, widest = start, 0
        while end < batch:
            widest_next = max(widest, spans[end])
            if end > start and (end + 1 - start) * widest_next * row_bytes > budget:
                break
            widest, end = widest_next, end + 1
        chunks.append(
            _chunk(block_tables, seq_lens, lo, first_block, slice(start, end), widest, single,
                   num_blocks, block_size)
        )  # fmt: skip
        start = end
    return chunks


def _chunk(
    block_tables: Tensor,
    seq_lens: Tensor,
    lo: Tensor,
    first_block: Tensor,
    seqs: slice,
    widest: int,
    single: bool,
    num_blocks: int,
    block_size: int,
) -> GatherChunk:
    device = block_tables.device
    n = seqs.stop - seqs.start
    if single:
        num_keys, width = widest, 0
        key_pos = torch.arange(num_keys, device=device).expand(n, num_keys)
        ids = block_tables[seqs, 0].long().clamp(0, num_blocks - 1)
    else:
        width = widest // block_size
        num_keys = widest
        first = first_block[seqs]
        cols = (first.unsqueeze(1) + torch.arange(width, device=device)).clamp(
            max=block_tables.shape[1] - 1
        )
        ids = block_tables[seqs].long().gather(1, cols).reshape(-1).clamp_(0, num_blocks - 1)
        key_pos = first.unsqueeze(1) * block_size + torch.arange(num_keys, device=device)
    in_range = (key_pos >= lo[seqs].unsqueeze(1)) & (key_pos < seq_lens[seqs].unsqueeze(1))
    stale_rows = (~in_range).view(-1).nonzero().squeeze(1)
    return GatherChunk(seqs, ids, width, num_keys, key_pos, in_range, stale_rows)


def gather(
    cache: Tensor,
    chunk: GatherChunk,
    scales: Tensor | None = None,
    head_scales: Tensor | None = None,
    out: Tensor | None = None,
    *,
    is_key: bool = True,
) -> Tensor:
    """``[n, num_keys, kv_heads, head_dim]`` float32 copy (or in ``out``'s
    dtype: a 16-bit cache's own, for ``ops.prefill_attention``) of the chunk's keys
    (or values), zero where a position is not the sequence's own. An 8-bit
    cache is dequantized here (int8 codes times their ``scales``,
    ``[num_blocks, block_size, kv_heads]``, or codes times the layer's static
    ``head_scales``, ``[kv_heads]``), chunk by chunk like the rest. ``out``:
    a flat float32 scratch buffer of at least ``chunk_numel`` elements to
    copy into (the result is a view of it), instead of a new tensor. An
    int4 cache (``kv_int4``) is read with its block scales, ``is_key``
    saying whether they are K's (per channel) or V's (per token)."""
    shape = (chunk.size, chunk.num_keys, *logical_shape(cache)[2:])
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=cache.device)
    else:
        out = out[: math.prod(shape)].view(shape)
    if is_int4(cache.dtype):
        assert scales is not None
        out.copy_(gather_int4(cache, scales, chunk.block_ids, chunk.width, chunk.num_keys, is_key))
    elif cache.dtype == torch.float32:
        _select(cache, chunk, out)
    elif cache.dtype in FP8_MAX and cache.device.type == "cpu":
        # torch's CPU fp8 cast runs element by element; a 256-entry table is ~4x faster
        codes = _select(as_bits(cache), chunk)
        torch.index_select(_fp8_values(cache.dtype), 0, codes.reshape(-1).int(), out=out.view(-1))
    else:  # float32 softmax and products, as the contract says
        out.copy_(_select(as_bits(cache), chunk).view(cache.dtype))
    if scales is not None and not is_int4(cache.dtype):
        out.mul_(_select(scales, chunk).float().unsqueeze(-1))
    if head_scales is not None:
        out.mul_(head_scales.to(device=out.device, dtype=torch.float32).unsqueeze(-1))
    if chunk.stale_rows.numel():
        out.view(chunk.size * chunk.num_keys, -1).index_fill_(0, chunk.stale_rows, 0.0)
    return out


def chunk_numel(cache: Tensor, chunk: GatherChunk) -> int:
    """Elements ``gather`` writes for ``chunk``: the scratch ``out`` it needs."""
    return chunk.size * chunk.num_keys * math.prod(logical_shape(cache)[2:])


@functools.cache
def _fp8_values(dtype: torch.dtype) -> Tensor:
    """float32 value of each of the 256 bit patterns of an fp8 ``dtype``."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).float()


def _select(cache: Tensor, chunk: GatherChunk, out: Tensor | None = None) -> Tensor:
    """The chunk's positions of ``cache`` (``[num_blocks, block_size, ...]``)
    as ``[n, num_keys, ...]`` (into ``out`` when given, of that shape)."""
    if chunk.width == 0:
        return torch.index_select(cache[:, : chunk.num_keys], 0, chunk.block_ids, out=out)
    rows = None if out is None else out.view(-1, *cache.shape[1:])
    picked = torch.index_select(cache, 0, chunk.block_ids, out=rows)
    return picked.view(chunk.size, chunk.num_keys, *cache.shape[2:])
