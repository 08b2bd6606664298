"""Capacity table: how many sequences fit at once, contiguous vs paged, at
equal KV bytes, *measured* by admitting sequences into the real pools.

The contiguous pool reserves ``max_model_len`` positions per row, so it holds
``num_rows`` sequences whatever their length. The paged pool gets the same
bytes as blocks (``num_rows * max_model_len / block_size`` of them) and hands
them out per ``block_size`` tokens, so short sequences leave room for more.
The average lengths default to ``max_model_len / 32`` doubling up to
``max_model_len`` (128..4096 at 4096), so any row length gives a full table.
For each average length we draw sequence lengths (uniform in
``[avg * (1 - spread), avg * (1 + spread)]``, capped at ``max_model_len``),
admit them one by one with ``allocate_sequence`` until a pool says no, and
count. Tiny per-token KV (one layer, one head) keeps it fast; the count does
not depend on the per-token size because both pools get the same bytes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch


def default_avg_lengths(max_model_len: int) -> tuple[int, ...]:
    """``max_model_len / 32`` doubling up to ``max_model_len`` (lengths below 1
    dropped): averages a fixed list would put past a short row length
    could never be drawn."""
    lengths = (max_model_len >> shift for shift in range(5, -1, -1))
    return tuple(sorted({n for n in lengths if n >= 1}))


@dataclass(slots=True)
class KVShape:
    """Per-token KV layout shared by both pools (bytes per token are equal)."""

    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 4
    dtype: torch.dtype = torch.float32

    @property
    def dims(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)``: the pools' ``from_model_config`` leading arguments."""
        return self.num_layers, self.num_kv_heads, self.head_dim


def make_contiguous_pool(shape: KVShape, num_rows: int, max_model_len: int) -> Any:
    """A real ``ContiguousKVPool`` with ``num_rows`` rows of ``max_model_len``."""
    from paged_ref import ContiguousKVPool

    return ContiguousKVPool.from_model_config(*shape.dims, max_model_len, num_rows, dtype=shape.dtype)


def make_paged_pool(shape: KVShape, num_blocks: int, block_size: int) -> Any:
    """A real ``PagedKVPool`` (prefix caching off: every prompt is distinct anyway)."""
    from paged_ref import PagedKVPool

    return PagedKVPool.from_model_config(
        *shape.dims, num_blocks, block_size, shape.dtype, enable_prefix_caching=False
    )


def pool_kv_bytes(pool: Any) -> int:
    """Bytes of the pool's K and V tensors (an int8 cache's scales included)."""
    return int(pool.kv_bytes())


def draw_lengths(
    avg: int, spread: float, max_model_len: int, rng: random.Random, n: int
) -> list[int]:
    """``n`` sequence lengths uniform around ``avg`` (exactly ``avg`` when
    ``spread`` is 0). The spread narrows near ``max_model_len`` so the mean
    stays ``avg``."""
    if not 1 <= avg <= max_model_len:
        raise ValueError(f"average length {avg} must be within 1..max_model_len ({max_model_len})")
    spread = min(spread, (max_model_len - avg) / avg, (avg - 1) / avg)
    lo, hi = round(avg * (1 - spread)), round(avg * (1 + spread))
    return [rng.randint(lo, hi) for _ in range(n)]


def admit_until_full(
    pool: Any, lengths: list[int], rng: random.Random, vocab: int = 30000
) -> list[int]:
    """Admit sequences of the given lengths in order (fresh random tokens,
    so no prefix sharing) until the pool refuses one; returns the admitted
    lengths. Uses the pool's own ``can_allocate_sequence``/``allocate_sequence``."""
    admitted: list[int] = []
    for n in lengths:
        tokens = [rng.randrange(vocab) for _ in range(n)]
        if not pool.can_allocate_sequence(tokens):
            break
        pool.allocate_sequence(tokens)
        admitted.append(n)
    problems = pool.audit()
    if problems:
        raise AssertionError(
            f"pool audit failed after admitting {len(admitted)} sequences: {problems}"
        )
    return admitted


@dataclass(slots=True, frozen=True)
class CapacitySettings:
    """What the table is measured with (the keywords of ``capacity_row`` and
    ``capacity_table``): ``num_rows`` contiguous rows of ``max_model_len``
    against as many token slots in ``block_size`` blocks, lengths within
    ``spread`` of each average, drawn from ``seed``; ``shape``: the
    per-token KV layout (``KVShape()`` when None)."""

    num_rows: int = 8
    max_model_len: int = 4096
    block_size: int = 16
    spread: float = 0.5
    seed: int = 0
    shape: KVShape | None = None


def capacity_row(avg_len: int, **settings: Any) -> dict[str, Any]:
    """Max concurrent sequences of average length ``avg_len`` in each pool
    (``settings``: ``CapacitySettings``' fields)."""
    s = CapacitySettings(**settings)
    num_rows, max_model_len, block_size = s.num_rows, s.max_model_len, s.block_size
    shape = s.shape or KVShape()
    if (num_rows * max_model_len) % block_size:
        raise ValueError(
            "num_rows * max_model_len must be a multiple of block_size for equal KV bytes"
        )
    num_blocks = num_rows * max_model_len // block_size
    contiguous = make_contiguous_pool(shape, num_rows, max_model_len)
    paged = make_paged_pool(shape, num_blocks, block_size)
    c_bytes, p_bytes = pool_kv_bytes(contiguous), pool_kv_bytes(paged)
    if c_bytes != p_bytes:
        raise AssertionError(f"pools differ in KV bytes: contiguous {c_bytes}, paged {p_bytes}")
    # Enough draws for the paged pool to fill even with the shortest lengths.
    rng = random.Random(f"capacity:{s.seed}:{avg_len}")
    upper = num_blocks * block_size // max(1, round(avg_len * (1 - s.spread))) + 2
    lengths = draw_lengths(avg_len, s.spread, max_model_len, rng, upper)
    c_admitted = admit_until_full(contiguous, lengths, random.Random(1))
    p_admitted = admit_until_full(paged, lengths, random.Random(2))
    return {
        "avg_len_target": avg_len,
        "contiguous": len(c_admitted),
        "paged": len(p_admitted),
        "ratio": round(len(p_admitted) / max(1, len(c_admitted)), 2),
        "paged_mean_len": round(sum(p_admitted) / max(1, len(p_admitted)), 1),
        "paged_tokens_held": sum(p_admitted),
        "kv_bytes": c_bytes,
    }


def capacity_table(avg_lengths: tuple[int, ...] | None = None, **settings: Any) -> dict[str, Any]:
    """The whole table plus the settings it was measured with (``settings``:
    ``CapacitySettings``' fields); ``avg_lengths`` defaults to
    ``default_avg_lengths(max_model_len)``."""
    s = CapacitySettings(**settings)
    if avg_lengths is None:
        avg_lengths = default_avg_lengths(s.max_model_len)
    table = [capacity_row(n, **settings) for n in avg_lengths]
    return {
        "kind": "capacity",
        "settings": {
            "num_rows": s.num_rows,
            "max_model_len": s.max_model_len,
            "block_size": s.block_size,
            "num_blocks": s.num_rows * s.max_model_len // s.block_size,
            "token_slots": s.num_rows * s.max_model_len,
            "length_spread": s.spread,
            "seed": s.seed,
        },
        "rows": table,
    }
