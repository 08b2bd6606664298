"""Paged decode attention: Triton kernel vs the reference gather paths.

Llama-3.2-3B attention layout (24 query heads, 8 kv heads, head_dim 128),
block size 16, every sequence at the full context, random page tables. One
layer, one decode step. Each group (same batch and context) holds:

- ``triton``: ``paged_triton.ops.paged_decode_attention`` (K/V read in place);
- ``ref``: ``paged_ref.ops.paged_decode_attention`` (gather + float32 attention);
- ``gather_sdpa``: gather through the block tables + torch SDPA (GQA), the
  strongest simple baseline.

``extra_info`` records the K/V bytes a step must read and the achieved
bandwidth (bytes / mean time). On CUDA every case runs in float16. Without
CUDA only the reference cases run (float32) plus one tiny interpreter case
of the Triton kernel, which checks that the benchmark runs, not speed.

Run: ``pytest benchmarks/test_decode_attention_bench.py --benchmark-only``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before paged_triton.ops is imported

from paged_ref import ops as ref_ops  # noqa: E402
from paged_ref.ops import gather_context  # noqa: E402
from paged_triton import ops as triton_ops  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 24, 8, 128, 16
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.float16 if CUDA else torch.float32
CPU_NOTE = (
    "no CUDA: Triton decode benchmarks need a GPU; on CPU only the reference cases "
    "and one tiny interpreter case run"
)


def gather_sdpa(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """Gather the pages into dense K/V, then torch SDPA (all sequences here
    have the full context, so no mask is needed)."""
    k = gather_context(k_cache, block_tables)
    v = gather_context(v_cache, block_tables)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)
    return out.squeeze(2)


IMPLS: dict[str, Callable] = {
    "triton": triton_ops.paged_decode_attention,
    "ref": ref_ops.paged_decode_attention,
    "gather_sdpa": gather_sdpa,
}


def make_step(batch: int, context: int) -> tuple:
    """A layer's caches holding exactly ``batch`` sequences of ``context``
    tokens in randomly permuted blocks, and their decode queries."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, dtype=DTYPE).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen, dtype=DTYPE).to(DEVICE)
    tables = (
        torch.randperm(num_blocks, generator=gen)
        .view(batch, blocks_per_seq)
        .to(DEVICE, torch.int32)
    )
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, dtype=DTYPE).to(DEVICE)
    return q, k_cache, v_cache, tables, seq_lens, HEAD_DIM**-0.5


def kv_bytes(batch: int, context: int, dtype: torch.dtype) -> int:
    """K and V bytes one decode step has to read (each visible key once)."""
    return 2 * batch * context * KV_HEADS * HEAD_DIM * torch.finfo(dtype).bits // 8


def run_case(benchmark, impl: str, batch: int, context: int, rounds: int | None) -> None:
    args = make_step(batch, context)
    fn = IMPLS[impl]

    def step() -> torch.Tensor:
        out = fn(*args)
        if CUDA:
            torch.cuda.synchronize()
        return out

    benchmark.group = f"decode b={batch} ctx={context}"
    if rounds is None:
        out = benchmark(step)
    else:
        out = benchmark.pedantic(step, rounds=rounds)
    assert torch.isfinite(out).all()
    nbytes = kv_bytes(batch, context, DTYPE)
    benchmark.extra_info.update(
        impl=impl,
        batch=batch,
        context=context,
        dtype=str(DTYPE),
        device=str(DEVICE),
        kv_bytes=nbytes,
        kv_GBps=nbytes / benchmark.stats.stats.mean / 1e9,
    )


@pytest.mark.parametrize("context", [512, 4096])
@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_decode_attention(benchmark, impl, batch, context):
    if impl == "triton" and not CUDA:
        pytest.skip(CPU_NOTE)
    # CPU: two rounds each, so the 4 GB float32 reference cases stay around a minute in all.
    run_case(benchmark, impl, batch, context, rounds=None if CUDA else 2)


@pytest.mark.skipif(CUDA, reason="the interpreter case only stands in for the GPU runs on CPU")
def test_decode_attention_interpreter_smoke(benchmark):
    """Triton's interpreter on a tiny step: proves the benchmark path runs
    without a GPU; its time says nothing about the kernel's speed."""
    print(CPU_NOTE)
    run_case(benchmark, "triton", batch=1, context=64, rounds=1)
    benchmark.extra_info["note"] = "Triton CPU interpreter: not a performance number"
