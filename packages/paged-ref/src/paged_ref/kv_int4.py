"""4-bit KV cache (``kv_cache_dtype="int4"``): KIVI's scheme fitted to paged blocks.

What a block stores (two 4-bit codes per byte, ``torch.uint8``):

- codes ``[num_blocks, block_size, kv_heads, head_dim // 2]``: channel ``2i``
  in the low nibble, ``2i + 1`` in the high one, so a token's row unpacks in
  registers with a shift and a mask;
- keys per channel (KIVI: key outliers sit in fixed channels): one float16
  ``(scale, min)`` pair per channel for each group of ``key_group(block_size)``
  consecutive tokens of a block (``K_GROUP_TOKENS`` = 64, or the whole block
  when it is smaller), ``k_scales [num_blocks, groups, kv_heads, 2, head_dim]``;
- values per token: one ``(scale, min)`` pair per token for each group of
  ``value_group(head_dim)`` channels (64, or the head when it is smaller),
  ``v_scales [num_blocks, block_size, kv_heads, 2, head_dim // group]``.

Asymmetric codes ``q = round((x - min) / scale)`` in ``0..15`` with
``scale = (max - min) / 15`` read back as ``q * scale + min``; the float16
scale and min are what both backends compute with.

Everything a block needs lives in the block's own rows of these three
tensors, so prefix caching, copy-on-write, forks, beam search and the hybrid
manager move int4 blocks exactly as they move 8-bit ones (copy_blocks
copies ``k_scales``/``v_scales`` by block like any scale tensor).

KIVI keeps the newest tokens at full precision until a key group is full;
here a key group is instead *re-quantized* when a token joins it: the
group's written codes are dequantized, the new keys added, and the group
quantized again over the new range. A group whose range does not grow keeps
its codes exactly; one whose range grows re-rounds older keys to the coarser
step (the bound is in ``tests/ref/test_kv_int4.py``). This keeps all state
inside the block (no per-sequence residual to fork, copy or preempt). It
relies on a block's tokens being written in position order, which the
engine always does: the written part of a group is its offsets up to the
newest token written.

At head_dim 64 and block size 64 a token costs 72 bytes per kv head (K and
V: 64 of codes, 4 of key and 4 of value scales) against 256 in 16 bits:
3.56x the tokens at equal bytes (7.1x fp32). At block size 16 a key group
is the block, 84 bytes: 3.05x.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

INT4_STORAGE = torch.uint8  # the cache tensors' dtype; means "packed int4" in a pool
INT4_SCALE_DTYPE = torch.float16
CODE_MAX = 15
K_GROUP_TOKENS = 64
V_GROUP_CHANNELS = 64


def is_int4(cache_dtype: torch.dtype) -> bool:
    """Whether a cache of this storage dtype holds packed 4-bit codes."""
    return cache_dtype == INT4_STORAGE


def key_group(block_size: int) -> int:
    """Tokens that share a key scale per channel: 64, or the block if smaller."""
    return min(block_size, K_GROUP_TOKENS)


def num_key_groups(block_size: int) -> int:
    return -(-block_size // key_group(block_size))


def value_group(head_dim: int) -> int:
    """Channels that share a value scale per token: 64, or the head if smaller."""
    return min(head_dim, V_GROUP_CHANNELS)


def check_head_dim(head_dim: int) -> None:
    if head_dim % 2 or head_dim % value_group(head_dim):
        raise ValueError(
            f"kv_cache_dtype int4 needs an even head_dim that is at most {V_GROUP_CHANNELS} "
            f"or a multiple of it (two codes per byte, value groups of {V_GROUP_CHANNELS} "
            f"channels); got head_dim {head_dim}"
        )


def head_dim_of(codes: Tensor) -> int:
    """The head_dim a packed cache holds (two codes per byte)."""
    return 2 * codes.shape[-1]


def scale_shapes(codes: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of ``k_scales`` and ``v_scales`` for packed ``codes``
    (``[..., num_blocks, block_size, kv_heads, head_dim // 2]``)."""
    *lead, block_size, kv_heads, _ = codes.shape
    head_dim = head_dim_of(codes)
    k_shape = (*lead, num_key_groups(block_size), kv_heads, 2, head_dim)
    v_shape = (*lead, block_size, kv_heads, 2, head_dim // value_group(head_dim))
    return tuple(k_shape), tuple(v_shape)


def new_int4_scales(codes: Tensor) -> tuple[Tensor, Tensor]:
    """Zeroed ``k_scales`` and ``v_scales`` for a packed cache."""
    check_head_dim(head_dim_of(codes))
    k_shape, v_shape = scale_shapes(codes)
    return (
        torch.zeros(k_shape, dtype=INT4_SCALE_DTYPE, device=codes.device),
        torch.zeros(v_shape, dtype=INT4_SCALE_DTYPE, device=codes.device),
    )


def check_int4_scales(codes: Tensor, scales: Tensor | None, name: str) -> None:
    """``k_scales``/``v_scales`` must be present and shaped for the cache."""
    k_shape, v_shape = scale_shapes(codes)
    want = k_shape if name.startswith("k") else v_shape
    if scales is None:
        raise ValueError(
            f"an int4 cache needs {name} {want} {INT4_SCALE_DTYPE} beside it; build the pool "
            "with kv_cache_dtype='int4'"
        )
    if tuple(scales.shape) != want or scales.dtype != INT4_SCALE_DTYPE:
        raise ValueError(
            f"{name} of an int4 cache must be {want} {INT4_SCALE_DTYPE}, got "
            f"{tuple(scales.shape)} {scales.dtype}"
        )


def int4_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """Bytes of one block across ``num_layers`` layers: codes and both scale tensors."""
    check_head_dim(head_dim)
    codes = 2 * block_size * num_kv_heads * head_dim // 2
    k_scales = num_key_groups(block_size) * num_kv_heads * 2 * head_dim * 2
    v_scales = block_size * num_kv_heads * 2 * (head_dim // value_group(head_dim)) * 2
    return num_layers * (codes + k_scales + v_scales)


def int4_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int
) -> int:
    """A block's bytes per token, rounded up (sizing stays conservative)."""
    return math.ceil(int4_block_bytes(num_layers, num_kv_heads, head_dim, block_size) / block_size)


# -- the math ----------------------------------------------------------------


def round_half_away(y: Tensor) -> Tensor:
    """Ties away from zero, as the Triton kernels round (``floor(y + 0.5)`` for y >= 0).
    (``kv_quant.round_half_away`` is the same; kv_quant imports this module, not the reverse.)"""
    return torch.where(y >= 0, torch.floor(y + 0.5), -torch.floor(0.5 - y))


def unpack(codes: Tensor) -> Tensor:
    """``[..., head_dim // 2]`` uint8 as ``[..., head_dim]`` codes 0..15 (uint8)."""
    return torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)


def pack(q: Tensor) -> Tensor:
    """``[..., head_dim]`` codes 0..15 (any integer or float dtype) as packed uint8."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def min_scale(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """float16 ``(scale, min)`` of a range, as stored: ``scale = (hi - lo) / 15``."""
    return ((hi - lo) / CODE_MAX).to(INT4_SCALE_DTYPE), lo.to(INT4_SCALE_DTYPE)


def quantize_with(x: Tensor, scale: Tensor, lo: Tensor) -> Tensor:
    """Codes 0..15 (float32) of ``x`` for broadcastable float16 ``scale``/``lo``;
    a zero scale (a constant group) gives code 0, read back as ``lo``."""
    s, m = scale.float(), lo.float()
    y = torch.where(s > 0, (x.float() - m) / torch.where(s > 0, s, 1.0), 0.0)
    return round_half_away(y).clamp_(0, CODE_MAX)


def dequantize_with(q: Tensor, scale: Tensor, lo: Tensor) -> Tensor:
    """``q * scale + lo`` in float32 (the kernels compute the same)."""
    return q.float() * scale.float() + lo.float()


def quantize_values(v: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token value codes: ``v`` ``[n, kv_heads, head_dim]`` as packed
    codes ``[n, kv_heads, head_dim // 2]`` and scales ``[n, kv_heads, 2, groups]``."""
    n, heads, head_dim = v.shape
    g = value_group(head_dim)
    x = v.float().view(n, heads, head_dim // g, g)
    scale, lo = min_scale(x.amin(-1), x.amax(-1))
    q = quantize_with(x, scale.unsqueeze(-1), lo.unsqueeze(-1))
    return pack(q.view(n, heads, head_dim)), torch.stack((scale, lo), dim=2)


def dequantize_values(codes: Tensor, scales: Tensor) -> Tensor:
    """Inverse of ``quantize_values`` for any leading dims: codes
    ``[..., kv_heads, head_dim // 2]``, scales ``[..., kv_heads, 2, groups]``."""
    q = unpack(codes)
    head_dim = q.shape[-1]
    groups = scales.shape[-1]
    q = q.view(*q.shape[:-1], groups, head_dim // groups)
    out = dequantize_with(q, scales[..., 0, :].unsqueeze(-1), scales[..., 1, :].unsqueeze(-1))
    return out.view(*out.shape[:-2], head_dim)


def quantize_keys(k: Tensor, written: Tensor) -> tuple[Tensor, Tensor]:
    """One key group per row: ``k`` ``[groups, tokens, kv_heads, head_dim]``,
    ``written`` ``[groups, tokens]`` bool. Returns packed codes (zeros where
    not written) and scales ``[groups, kv_heads, 2, head_dim]``, each
    channel's range taken over the written tokens."""
    x = k.float()
    w = written[:, :, None, None]
    lo = torch.where(w, x, math.inf).amin(1)
    hi = torch.where(w, x, -math.inf).amax(1)
    empty = ~written.any(1)[:, None, None]  # a group with nothing written keeps zeros
    lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    scale, m = min_scale(lo, hi)
    q = quantize_with(x, scale.unsqueeze(1), m.unsqueeze(1)).masked_fill_(~w, 0)
    return pack(q), torch.stack((scale, m), dim=2)


def write_values(codes: Tensor, scales: Tensor, v: Tensor, slots: Tensor) -> None:
    """Store ``v`` (``[n, kv_heads, head_dim]``) at ``slots`` (no padding) of
    one layer's value cache ``[num_blocks, block_size, kv_heads, head_dim // 2]``."""
    packed, new_scales = quantize_values(v)
    rows = codes.shape[0] * codes.shape[1]
    codes.view(rows, *codes.shape[2:]).index_copy_(0, slots, packed)
    scales.view(rows, *scales.shape[2:]).index_copy_(0, slots, new_scales)


def write_keys(codes: Tensor, scales: Tensor, k: Tensor, slots: Tensor) -> None:
    """Store ``k`` at ``slots`` of one layer's key cache, re-quantizing every
    key group a new token joins over its written tokens (see module doc):
    the group's earlier keys are read back, the new ones put beside them,
    and the group quantized again."""
    num_blocks, block_size = codes.shape[:2]
    group = key_group(block_size)
    ngroups = num_key_groups(block_size)
    block, offset = slots // block_size, slots % block_size
    gid = block * ngroups + offset // group
    uniq, inv = torch.unique(gid, return_inverse=True)
    in_group = offset - (offset // group) * group
    last = torch.full((uniq.shape[0],), -1, dtype=torch.long, device=codes.device)
    last.scatter_reduce_(0, inv, in_group, "amax")
    ub, ug = uniq // ngroups, uniq % ngroups
    j = torch.arange(group, device=codes.device)
    pos = ug.unsqueeze(1) * group + j  # [U, group] offsets in the block
    inside = pos < block_size  # a last group may be short (block_size not a multiple)
    rows = (ub.unsqueeze(1) * block_size + pos.clamp(max=block_size - 1)).reshape(-1)
    flat = codes.view(num_blocks * block_size, *codes.shape[2:])
    old_scales = scales[ub, ug]  # [U, kv_heads, 2, head_dim]
    x = dequantize_with(
        unpack(flat[rows]).view(uniq.shape[0], group, *k.shape[1:]),
        old_scales[:, None, :, 0], old_scales[:, None, :, 1],
    )  # fmt: skip
    x[inv, in_group] = k.float()
    written = (j.unsqueeze(0) <= last.unsqueeze(1)) & inside
    packed, new_scales = quantize_keys(x, written)
    keep = inside.reshape(-1)
    flat.index_copy_(0, rows[keep], packed.reshape(-1, *codes.shape[2:])[keep])
    scales[ub, ug] = new_scales


def select_rows(cache: Tensor, block_ids: Tensor, width: int, num_keys: int) -> Tensor:
    """The blocks' (or, ``width == 0``, single blocks' first ``num_keys``) rows."""
    if width == 0:
        return torch.index_select(cache[:, :num_keys], 0, block_ids)
    return torch.index_select(cache, 0, block_ids)


def gather_int4(
    codes: Tensor, scales: Tensor, block_ids: Tensor, width: int, num_keys: int, is_key: bool
) -> Tensor:
    """Dequantized ``[n, num_keys, kv_heads, head_dim]`` float32 of the blocks
    ``block_ids`` (``width`` per sequence, or ``width == 0``: one block per
    sequence, its first ``num_keys`` positions); one index_select each of the
    codes and of the scales, then the unpack and ``q * scale + min``."""
    block_size = codes.shape[1]
    picked = select_rows(codes, block_ids, width, num_keys)  # [m, t, H, D/2]
    if is_key:
        group = key_group(block_size)
        s = torch.index_select(scales, 0, block_ids)  # [m, groups, H, 2, D]
        t = picked.shape[1]
        s = s[:, torch.arange(t, device=codes.device) // group]  # [m, t, H, 2, D]
        out = dequantize_with(unpack(picked), s[..., 0, :], s[..., 1, :])
    else:
        s = select_rows(scales, block_ids, width, num_keys)  # [m, t, H, 2, G]
        out = dequantize_values(picked, s)
    n = block_ids.shape[0] if width == 0 else block_ids.shape[0] // width
    return out.reshape(n, num_keys, *out.shape[2:])
