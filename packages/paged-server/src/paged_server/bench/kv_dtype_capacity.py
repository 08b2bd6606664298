"""KV cache dtype capacity: tokens and sequences that fit in equal KV bytes,
``auto`` (the model dtype) vs ``fp8`` vs ``fp8_e5m2`` vs ``int8``, and
``int8`` / ``fp8`` with ``calculate_kv_scales`` (static scales per layer and
kv head: no per-token scale bytes).

Measured on real paged pools (``device="meta"``: sized, never allocated):
each dtype's pool gets as many blocks as ``budget_bytes`` holds
(``KVCacheSpec.blocks_in``, int8 per-token scales counted), then
sequences of ``avg_len`` tokens are admitted with ``allocate_sequence``
until the pool refuses one. The layout defaults to Llama 3.2 1B's
(16 layers, 8 kv heads x 64), where an int8 per-token scale costs 2 bytes
per 64; with calculated scales int8 holds exactly 2x a 16-bit cache.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

import torch

from paged_server.bench.capacity import admit_until_full
from paged_server.config import KV_CACHE_DTYPES

MODEL_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# (kv_cache_dtype, calculate_kv_scales) rows; fp8_e4m3 is the same format as fp8.
VARIANTS = [
    *((kv, False) for kv in KV_CACHE_DTYPES if kv != "fp8_e4m3"),
    ("int8", True),
    ("fp8", True),
]


@dataclass(slots=True)
class KVLayout:
    """A model's per-token KV shape."""

    name: str = "Llama 3.2 1B"
    num_layers: int = 16
    num_kv_heads: int = 8
    head_dim: int = 64


def kv_dtype_capacity_row(
    kv_cache_dtype: str,
    model_dtype: str,
    budget_bytes: int,
    avg_len: int,
    *,
    layout: KVLayout,
    block_size: int = 16,
    seed: int = 0,
    calculate_kv_scales: bool = False,
) -> dict[str, Any]:
    """One dtype's blocks, tokens and admitted sequences in ``budget_bytes``
    (``calculate_kv_scales``: the pool keeps static scales, whatever their values)."""
    from paged_ref import PagedKVPool
    from paged_ref.kv_spec import KVCacheSpec

    static = calculate_kv_scales
    spec = KVCacheSpec.dense(
        layout.num_layers, layout.num_kv_heads, layout.head_dim, MODEL_DTYPES[model_dtype],
        kv_cache_dtype=kv_cache_dtype, block_size=block_size, static_scales=static,
    )  # fmt: skip
    num_blocks = spec.blocks_in(budget_bytes)
    ones = torch.ones(layout.num_layers, layout.num_kv_heads)
    pool = PagedKVPool.from_spec(
        spec, num_blocks, "meta", enable_prefix_caching=False,
        kv_scales=(ones, ones) if static else None,
    )  # fmt: skip
    tokens = num_blocks * block_size
    lengths = [avg_len] * (tokens // avg_len + 2)
    admitted = admit_until_full(pool, lengths, random.Random(seed))
    return {
        "kv_cache_dtype": kv_cache_dtype,
        "calculate_kv_scales": static,
        "model_dtype": model_dtype,
        "stored_as": str(spec.cache_dtype).removeprefix("torch."),
        "bytes_per_token": spec.token_bytes(),
        "num_blocks": num_blocks,
        "tokens": tokens,
        "kv_bytes": pool.kv_bytes(),
        "sequences": len(admitted),
    }


def kv_dtype_capacity_table(
    budget_bytes: int = 1 << 30,
    avg_len: int = 512,
    *,
    layout: KVLayout | None = None,
    block_size: int = 16,
) -> dict[str, Any]:
    """Every ``VARIANTS`` row for a 16-bit and a float32 model, with each
    row's tokens and sequences relative to ``auto`` of the same model dtype."""
    layout = layout or KVLayout()
    rows = []
    for model_dtype in MODEL_DTYPES:
        base = None
        for kv, calc in VARIANTS:
            row = kv_dtype_capacity_row(
                kv, model_dtype, budget_bytes, avg_len, layout=layout, block_size=block_size,
                calculate_kv_scales=calc,
            )  # fmt: skip
            base = base or row
            row["tokens_vs_auto"] = round(row["tokens"] / base["tokens"], 3)
            row["sequences_vs_auto"] = round(row["sequences"] / max(1, base["sequences"]), 3)
            rows.append(row)
    return {
        "kind": "kv_dtype_capacity",
        "settings": {
            "budget_bytes": budget_bytes,
            "avg_len": avg_len,
            "block_size": block_size,
            "layout": asdict(layout),
        },
        "rows": rows,
    }
