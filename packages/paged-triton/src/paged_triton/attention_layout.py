"""What the decode and prefill wrappers share, written once: the checks
before a launch, and a layer's layout (head programs, constexprs, tile, and
the cache arguments both kernels take) from its shapes alone."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import triton
from torch import Tensor

from paged_ref.kv_quant import logical_shape
from paged_triton.decode_splits import BLOCK_B
from paged_triton.launch_checks import (
    check_cache,
    check_gqa,
    check_quantized_cache,
    check_runnable,
    compute_dtype,
    dot_precision,
    kv_quant_mode,
    scale_args,
)
from paged_triton.tile_config import MIN_DOT, TileConfig, tile_config

# Query heads one program serves at most; more heads per kv head are split over programs.
MAX_HEADS_PER_PROGRAM = {"decode": 64, "prefill": 16}


def check_attention(
    kernel: object, q: Tensor, k_cache: Tensor, v_cache: Tensor, rows: str, **scales: Tensor | None
) -> None:
    """Device, cache layout, 8-bit scales, ``q``'s shape (``[rows, heads,
    head_dim]``), head_dim and GQA: raise with what to change."""
    check_runnable(kernel, q, k_cache, v_cache)
    check_cache(k_cache, v_cache)
    check_quantized_cache(
        k_cache, scales.get("k_scales"), scales.get("v_scales"),
        scales.get("k_head_scales"), scales.get("v_head_scales"),
    )  # fmt: skip
    if q.dim() != 3:
        raise ValueError(f"q must be [{rows}, heads, head_dim], got shape {tuple(q.shape)}")
    cache_head_dim = logical_shape(k_cache)[3]  # (an int4 cache packs two per byte)
    if cache_head_dim != q.shape[2]:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {cache_head_dim}")
    check_gqa(q.shape[1], k_cache.shape[2])


class LayerLayout(NamedTuple):
    head_programs: int  # programs along the head axis
    constexprs: dict[str, Any]  # window and softcap flags aside
    tile: TileConfig
    caches: tuple[Tensor, Tensor, Tensor | None, Tensor | None]  # K, V, K_SCALE, V_SCALE
    cache_strides: tuple[int, ...]  # block, kv head, token in the block; scales: block, token


def layer_layout(
    kind: str, q: Tensor, k_cache: Tensor, v_cache: Tensor, arch: int | None, interpret: bool,
    tile: TileConfig | None, scales: dict[str, Tensor | None],
) -> LayerLayout:  # fmt: skip
    """A ``"decode"`` or ``"prefill"`` launch's layout for this layer
    (``tile``: instead of :func:`tile_config`'s choice, for autotuning),
    with the cache arguments both kernels take in the same order."""
    k_head = scales.get("k_head_scales")
    head_programs, constexprs, tile = _shape_params(
        kind, q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1],
        compute_dtype(q.dtype, k_cache.dtype), arch,
        interpret and torch.bfloat16 in (q.dtype, k_cache.dtype), tile,
        kv_quant_mode(k_cache.dtype), k_head is not None,
    )  # fmt: skip
    k_scale, v_scale, strides = scale_args(
        k_cache, v_cache, scales.get("k_scales"), scales.get("v_scales"), k_head,
        scales.get("v_head_scales"),
    )  # fmt: skip
    cs = k_cache.stride()
    return LayerLayout(
        head_programs, constexprs, tile, (k_cache, v_cache, k_scale, v_scale),
        (cs[0], cs[2], cs[1], *strides),
    )  # fmt: skip


@functools.lru_cache(maxsize=512)
def _shape_params(
    kind: str, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
    arch: int | None, emulate_bf16: bool, tile: TileConfig | None, kv_quant: int, head_scales: bool,
) -> tuple[int, dict[str, Any], TileConfig]:  # fmt: skip
    """What depends only on the layer's shapes (``dtype``: what the products
    run in, ``compute_dtype``). Decode pads its query heads to ``BLOCK_H``
    rows; prefill stacks ``BLOCK_Q`` queries of ``HEADS_PAD`` heads each."""
    q_per_kv = check_gqa(heads, kv_heads)
    heads_per_prog = min(q_per_kv, MAX_HEADS_PER_PROGRAM[kind])
    block_d = max(MIN_DOT, triton.next_power_of_2(head_dim))
    tile = tile or tile_config(kind, block_d, dtype, arch, quantized=kv_quant != 0,
                               int4=kv_quant == 3)  # fmt: skip
    constexprs: dict[str, Any] = dict(
        Q_PER_KV=q_per_kv, HEADS_PER_PROG=heads_per_prog, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=tile.block_n, PRECISION=dot_precision(dtype),
        EMULATE_BF16=emulate_bf16, KV_QUANT=kv_quant, HEAD_SCALES=head_scales,
    )  # fmt: skip
    if kind == "decode":
        constexprs.update(BLOCK_H=max(MIN_DOT, triton.next_power_of_2(heads_per_prog)), BLOCK_B=BLOCK_B)
    else:
        heads_pad = triton.next_power_of_2(heads_per_prog)
        constexprs.update(HEADS_PAD=heads_pad, BLOCK_Q=max(1, tile.block_m // heads_pad))
    return kv_heads * triton.cdiv(q_per_kv, heads_per_prog), constexprs, tile
