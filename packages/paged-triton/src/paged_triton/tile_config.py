"""Tile sizes, warps and pipeline stages per kernel, head_dim, dtype and GPU.

:func:`tile_config` is the one place a kernel's launch shape is chosen. The
table below was read off the compile matrix (``compile_matrix.py``, run in
``nox -s test`` for sm_80, sm_89 and sm_90): every entry compiles without
register spills in 16-bit dtypes and within the target's shared memory.

Why these numbers (compile data for bf16, the same for fp16):
- K/V tiles are read through the page table, so Triton's software pipeliner
  spends two stages on the block-id load before the K/V load; with 3 or 4
  stages K/V get one shared-memory buffer (the next tile is only fetched
  after the current one is used); 5 stages give them two, so one tile is in
  flight while the other is computed (``kv_buffers`` in the matrix).
- decode (16 padded query rows, 4 warps): 64-key tiles, 32 when a K/V row
  is 512 bytes (head_dim 256): 37-73 KB shared, 64-168 registers, no spills.
- prefill: per GPU class (:data:`PREFILL_TILES`, why in its comment). Its
  8-warp tiles set ``maxnreg=255``: left alone, ptxas aimed at 128
  registers (two blocks per SM) and spilled 8 B for GQA-8 on sm_80, where
  shared memory allows one block per SM anyway. Before the per-GPU table
  (one table for all): d64 64 x 64 x 4 warps; d128 64 x 64 x 8 warps (4
  spilled 40-64 B on sm_80/89); d256 64 x 32 x 8 warps where shared memory
  is large and 32 x 32 x 4 on the 99 KB GPUs (4 warps x 64 x 64 spilled
  8-200 B and needed 104-160 KB).
- Rows of 1 KB (float32 x head_dim 256) halve the key tile again.

On a GPU, ``PAGED_TRITON_AUTOTUNE=1`` makes the ops time the
:func:`candidates` (18-24 per kernel, each compiled and timed with
``do_bench``) once per layer shape, on its first call (so: in a warm-up),
and keep the fastest (:func:`tuned`). It is off by default, and never used
in the interpreter. (Written without a GPU: not yet run on one.)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

KERNELS = ("decode", "prefill")
MIN_DOT = 16  # tl.dot wants every dimension >= 16

# Most shared memory one block may use (opt-in), bytes.
SMEM_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448}
SMALL_SMEM = 101376  # sm_86, sm_89, sm_120 and unknown GPUs


@dataclass(frozen=True, slots=True)
class TileConfig:
    """``block_m``: query rows per program (prefill; queries x padded query heads);
    ``block_n``: keys per tile; Triton's ``num_warps`` and ``num_stages``;
    ``maxnreg``: registers per thread ptxas may use (``None``: its choice)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: int | None = None


# Prefill tiles of 16-bit K/V rows (bytes: 128 = head_dim 64, 256 = 128, 512 = 256) per
# GPU class. FlashAttention-2 runs 128 query rows where registers allow (d64: 128 x 128;
# d128: 128 x 64 on A100/H100, square 64 x 64 for causal on sm_86/sm_89; d256: 64 x 64 on
# H100) and vLLM's Triton prefill 128 x 64. Ours hold more per thread (row pointers and
# positions, Triton's layouts), so the compile matrix decides (bf16, registers/spills):
# - d64: 128 query rows x 8 warps (4 spilled 32-40 B on sm_80/89): sm_90 FlashAttention's
#   128 x 128 keys (202 registers, 255 with window + soft-cap; 113 KB), which spilled 16 B
#   on sm_80; sm_80 128 x 64 (186, 255 with window + soft-cap); sm_89 128 x 32 (178-204:
#   128 x 64 spilled 8 B with window + soft-cap), FlashAttention's sm_86/89 choice for
#   2 blocks per SM.
# - d128: sm_90 128 x 64 (206 registers, 129 KB, 3 K/V buffers); it spilled 16-24 B on
#   sm_80/89 (4 warps: 384-608 B), so sm_80 takes 128 x 32 (255, no spill) and sm_89
#   keeps FlashAttention's square 64 x 64.
# - d256: 128-row tiles spilled 216-280 B on sm_80/89 and left 0-2 registers on sm_90; 64 x
#   64 needs 169 KB (over sm_80's 163 KB) and 225 KB on sm_90: the 64 x 32 tiles stay.
# Stages stay 5: with 3 or 4 the pipeliner gave K/V one buffer on sm_80/89 (the page-table
# load takes a stage), so each tile would wait for its own load. ``None`` (the interpreter,
# which ignores warps and stages) keeps the smaller generic tiles.
PREFILL_TILES: dict[str | None, dict[int, TileConfig]] = {
    "hopper": {128: TileConfig(128, 128, 8, 5, 255), 256: TileConfig(128, 64, 8, 5, 255),
               512: TileConfig(64, 32, 8, 5, 255)},
    "ampere": {128: TileConfig(128, 64, 8, 5, 255), 256: TileConfig(128, 32, 8, 5, 255),
               512: TileConfig(64, 32, 8, 5, 255)},
    "ada": {128: TileConfig(128, 32, 8, 5, 255), 256: TileConfig(64, 64, 8, 5, 255),
            512: TileConfig(32, 32, 4, 5)},
    None: {128: TileConfig(64, 64, 4, 5), 256: TileConfig(64, 64, 8, 5, 255),
           512: TileConfig(32, 32, 4, 5)},
}  # fmt: skip


def gpu_class(arch: int | None) -> str | None:
    """``"hopper"`` (sm_90), ``"ampere"`` (the other GPUs with >= 163 KB of
    shared memory per block: sm_80, sm_87, sm_100), ``"ada"`` (the 99 KB
    ones: sm_86, sm_89, sm_120 and unknown GPUs); ``None``: the interpreter."""
    if arch is None:
        return None
    if arch == 90:
        return "hopper"
    return "ampere" if _large_smem(arch) else "ada"


def smem_limit(arch: int) -> int:
    """Shared memory per block on compute capability ``arch`` (e.g. 89)."""
    if arch in SMEM_LIMIT:
        return SMEM_LIMIT[arch]
    return 232448 if arch in (100, 103) else SMALL_SMEM


def _large_smem(arch: int | None) -> bool:
    return arch is not None and smem_limit(arch) > SMALL_SMEM


def tile_config(
    kernel: str,
    block_d: int,
    dtype: torch.dtype,
    arch: int | None,
    quantized: bool = False,
    int4: bool = False,
) -> TileConfig:
    """The launch shape of ``kernel`` ("decode" or "prefill") for head_dim
    padded to ``block_d``, compute ``dtype``, on compute capability ``arch``
    (``None``: Triton's interpreter, which ignores warps and stages).
    ``quantized``: the cache is 8-bit and each tile is dequantized in
    registers (see :func:`_quantized_tile`); ``int4``: 4-bit, whose keys
    also hold a per-channel scale and min tile: the prefill of head_dim 256
    with 64 queries x 8 warps spilled 592 B on sm_80 (4 warps x 32: 8 B);
    32 queries x 8 warps does not."""
    row_bytes = block_d * dtype.itemsize  # one token's K (or V) for one head
    if int4 and kernel == "prefill" and row_bytes > 256:
        return TileConfig(32, 16, 8, 5, maxnreg=255)
    if quantized:
        return _quantized_tile(kernel, row_bytes, arch)
    if kernel == "decode":
        return TileConfig(0, 64 if row_bytes <= 256 else 32 if row_bytes <= 512 else 16, 4, 5)
    if kernel == "prefill":
        if row_bytes > 512:
            return TileConfig(32, 16, 4, 5)
        return PREFILL_TILES[gpu_class(arch)][128 if row_bytes <= 128 else row_bytes]
    raise ValueError(f"no tile configuration for kernel {kernel!r}; known: {KERNELS}")


def _quantized_tile(kernel: str, row_bytes: int, arch: int | None) -> TileConfig:
    """Tiles for 8-bit caches. Dequantizing a tile holds its codes, their
    float32 products and the scales at once, so the 16-bit tiles spilled
    (compile matrix, int8 caches): decode d128 bf16 16 B on sm_90; prefill
    d64 fp16 72 B on sm_80/sm_89; prefill d256 bf16 with window and soft-cap
    40-88 B everywhere. Halving the key tile (and 8 warps for d64 prefill)
    removes every spill; half the keys per tile costs a little pipelining,
    not bytes read. Prefill d256 with static per-head scales
    (``calculate_kv_scales``) still spilled 560-584 B per thread on sm_80
    with 64 query rows (found by compiling every family's warm-up list);
    32 rows x 16 keys x 8 warps: 188-238 registers, no spill, 34-49 KB."""
    if kernel == "decode":
        return TileConfig(0, 32 if row_bytes <= 256 else 16, 4, 5, maxnreg=255)
    if kernel == "prefill":
        if row_bytes <= 256:
            return TileConfig(64, 32, 8, 5, maxnreg=255)
        if arch is not None and arch >= 90:
            return TileConfig(64, 16, 8, 5, maxnreg=255)
        if _large_smem(arch):  # sm_80/sm_87
            return TileConfig(32, 16, 8, 5, maxnreg=255)
        return TileConfig(32, 16, 4, 5)
    raise ValueError(f"no tile configuration for kernel {kernel!r}; known: {KERNELS}")


def autotune_enabled(device: torch.device) -> bool:
    """``PAGED_TRITON_AUTOTUNE=1`` and a CUDA device."""
    return device.type == "cuda" and os.environ.get("PAGED_TRITON_AUTOTUNE") == "1"


def candidates(
    kernel: str, block_d: int, dtype: torch.dtype, arch: int | None, quantized: bool = False
) -> list[TileConfig]:
    """Configurations worth timing: the table's choice first, then its
    neighbours (tile, warps, stages). Some may not fit a given GPU; the
    tuner skips those that fail to compile or launch."""
    chosen = tile_config(kernel, block_d, dtype, arch, quantized)
    if kernel == "decode":
        others = [TileConfig(0, n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (3, 4, 5)]
    else:
        others = [
            TileConfig(m, n, w, s, 255 if w == 8 else None)
            for m, n in PREFILL_CANDIDATE_SHAPES
            for w in (4, 8)
            for s in (3, 5)
        ]
    return [chosen] + [c for c in others if c != chosen]


# Prefill (query rows, keys) worth timing: FlashAttention-2's (128 x 128 / 64 / 32, 64 x
# 64) and vLLM's (128 x 64) and the smaller ones the 99 KB GPUs and head_dim 256 need.
# With 3 stages (one K/V buffer on sm_80/89, two on sm_90) and 5: 24 candidates.
PREFILL_CANDIDATE_SHAPES = ((128, 128), (128, 64), (128, 32), (64, 64), (64, 32), (32, 32))


_TUNED: dict[Hashable, TileConfig] = {}


def tuned(
    key: Hashable, options: list[TileConfig], time_ms: Callable[[TileConfig], float]
) -> TileConfig:
    """The fastest of ``options`` by ``time_ms`` (which runs the kernel with
    that configuration), measured once per ``key`` and remembered. An
    option whose run raises (too much shared memory on this GPU, say) is
    skipped; if all fail, the first (the table's choice) is kept."""
    if key not in _TUNED:
        timings = []
        for option in options:
            try:
                timings.append((time_ms(option), option))
            except Exception:  # a candidate this GPU cannot run is not a choice
                timings.append((math.inf, option))
        best = min(timings, key=lambda t: t[0])
        _TUNED[key] = best[1] if math.isfinite(best[0]) else options[0]
    return _TUNED[key]


def tuned_tiles(kernel: str) -> dict[str, TileConfig]:
    """What :func:`tuned` chose so far for ``kernel`` ("decode" or
    "prefill"), by its layer-shape key (as text): the autotune table a GPU
    run writes out (``benchmarks/gpu_serving.py`` with
    ``PAGED_GPU_TUNE_PREFILL=1``) for the static table to take up."""
    return {repr(key[1:]): tile for key, tile in _TUNED.items()
            if isinstance(key, tuple) and key and key[0] == kernel}  # fmt: skip
