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
- prefill, head_dim 64: 64 query rows x 64 keys, 4 warps (155-162 registers).
- prefill, head_dim 128: the old 4 warps x 64x64 tiles spilled 40-64 B per
  thread on sm_80/sm_89; 8 warps: 146-198 registers, 88.5 KB (112.5 KB on sm_90).
  8-warp tiles set ``maxnreg=255``: left alone, ptxas aimed at 128
  registers (two blocks per SM) and spilled 8 B for GQA-8 on sm_80, where
  shared memory allows one block per SM anyway (219 registers, no spill).
- prefill, head_dim 256 (Gemma 3): 4 warps x 64x64 tiles spilled 8-200 B
  per thread (sm_90 least, sm_80 most) and needed 104-160 KB; now 8 warps x 64 rows x 32 keys where
  shared memory is large (sm_80: 100 KB, sm_90: 128 KB), and 4 warps x 32
  rows x 32 keys on the 99 KB GPUs (sm_86/sm_89: 82 KB, 210 registers).
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
        if row_bytes <= 128:
            return TileConfig(64, 64, 4, 5)
        if row_bytes <= 256:
            return TileConfig(64, 64, 8, 5, maxnreg=255)
        if row_bytes <= 512:
            if _large_smem(arch):
                return TileConfig(64, 32, 8, 5, maxnreg=255)
            return TileConfig(32, 32, 4, 5)
        return TileConfig(32, 16, 4, 5)
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
            for m, n in ((32, 32), (64, 32), (64, 64), (128, 64))
            for w in (4, 8)
            for s in (3, 4, 5)
        ]
    return [chosen] + [c for c in others if c != chosen]


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
