"""Triton ops on a packed int4 KV cache (paged_ref/kv_int4.py) against
paged_ref.ops on randomized page tables: write_kv bit for bit (values per
token; key groups re-quantized by the last new token of each group), decode
and prefill attention within the 8-bit tolerances (both sides read the same
codes and float16 scales; conftest.py), copy_blocks of codes and both scale
tensors. Shapes stay tiny: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch

from paged_ref import PagedKVPool
from paged_ref import ops as ref_ops
from paged_triton import ops
from paged_triton.decode_splits import SplitPolicy

SPLIT = SplitPolicy(min_chunk=16, target_programs=1 << 20, max_splits=4)


def int4_pool(num_blocks, block_size, kv_heads, head_dim, paged, layers=1):
    return PagedKVPool.from_model_config(layers, kv_heads, head_dim, num_blocks, block_size,
                                         torch.float32, paged.device, kv_cache_dtype="int4")  # fmt: skip


def fill(pool, tables, lens, gen, paged):
    """Write each sequence's keys and values (N(0, 1), an outlier channel)
    in two pieces through the reference, so groups hold re-quantized codes."""
    bs = pool.block_size
    for b, n in enumerate(lens):
        if n == 0:
            continue
        slots = torch.tensor([int(tables[b, p // bs]) * bs + p % bs for p in range(n)])
        k = torch.randn(n, pool.num_kv_heads, pool.head_dim, generator=gen)
        k[:, :, 1] *= 8
        v = torch.randn(n, pool.num_kv_heads, pool.head_dim, generator=gen)
        cut = max(1, n // 3)
        for part in (slice(0, cut), slice(cut, n)):
            ref_ops.write_kv(pool.k_cache[0], pool.v_cache[0], k[part].to(paged.device),
                             v[part].to(paged.device), slots[part].to(paged.device),
                             k_scales=pool.k_scales[0], v_scales=pool.v_scales[0])  # fmt: skip


def kw(pool):
    return {"k_scales": pool.k_scales[0], "v_scales": pool.v_scales[0]}


@pytest.mark.parametrize(("block_size", "head_dim"), [(8, 32), (16, 128)])
def test_write_kv_int4_is_bit_identical(block_size, head_dim, gen, paged):
    """One batch: a sequence continuing a partly written key group, one
    starting fresh across several groups, a single decode token, padding."""
    kv_heads, num_blocks = 2, 8
    pool = int4_pool(num_blocks, block_size, kv_heads, head_dim, paged)
    # earlier writes: block 3 holds 5 tokens, block 6 holds 2
    first = torch.tensor([3 * block_size + i for i in range(5)] + [6 * block_size, 6 * block_size + 1])
    x = torch.randn(7, kv_heads, head_dim, generator=gen).to(paged.device)
    ref_ops.write_kv(pool.k_cache[0], pool.v_cache[0], x, x * 2, first.to(paged.device), **kw(pool))
    slots = [3 * block_size + i for i in range(5, block_size)]  # fill block 3's group(s)
    slots += [-1]
    slots += [1 * block_size + i for i in range(block_size)] + [4 * block_size, 4 * block_size + 1]
    slots += [6 * block_size + 2]  # a decode token
    slots = torch.tensor(slots).to(paged.device)
    n = slots.shape[0]
    fused = torch.randn(n, 3 * kv_heads, head_dim, generator=gen).to(paged.device)
    fused[2, kv_heads:] = 0.0  # an all-zero token: scale 0
    k, v = fused[:, kv_heads : 2 * kv_heads], fused[:, 2 * kv_heads :]  # strided views
    want = [t.clone() for t in (pool.k_cache[0], pool.v_cache[0], pool.k_scales[0], pool.v_scales[0])]
    ref_ops.write_kv(want[0], want[1], k, v, slots, k_scales=want[2], v_scales=want[3])
    ops.write_kv(pool.k_cache[0], pool.v_cache[0], k, v, slots, **kw(pool))
    got = (pool.k_cache[0], pool.v_cache[0], pool.k_scales[0], pool.v_scales[0])
    for name, a, b in zip(("k codes", "v codes", "k scales", "v scales"), got, want, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16], ids=["q-fp32", "q-fp16"])
@pytest.mark.parametrize("policy", [None, SPLIT], ids=["auto-split", "split"])
def test_int4_decode_matches_reference(q_dtype, policy, gen, paged):
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 8
    lens = [45, 3 * block_size, 1, block_size - 1]
    tables = paged.random_block_tables(lens, block_size, 24, gen, share=False)
    pool = int4_pool(24, block_size, kv_heads, head_dim, paged)
    fill(pool, tables, lens, gen, paged)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(paged.device, q_dtype)
    args = (q, pool.k_cache[0], pool.v_cache[0], tables.to(paged.device),
            torch.tensor(lens, dtype=torch.int32).to(paged.device))  # fmt: skip
    for window in (None, 20):
        out = paged.decode_attention(*args, 0.2, window, policy=policy, **kw(pool))
        paged.assert_close(out, ref_ops.paged_decode_attention(*args, 0.2, window, **kw(pool)), q_dtype)


def test_int4_prefill_matches_reference(gen, paged):
    heads, kv_heads, head_dim, block_size = 4, 1, 64, 16
    seqs = [(40, 20), (2 * block_size, 2 * block_size), (block_size + 3, 1)]
    lens = [n for n, _ in seqs]
    tables = paged.random_block_tables(lens, block_size, 12, gen, share=False)
    pool = int4_pool(12, block_size, kv_heads, head_dim, paged)
    fill(pool, tables, lens, gen, paged)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor([q for _, q in seqs]).cumsum(0)
    q = torch.randn(int(cu[-1]), heads, head_dim, generator=gen).to(paged.device)
    args = (q, pool.k_cache[0], pool.v_cache[0], tables.to(paged.device), cu.to(paged.device),
            torch.tensor(lens, dtype=torch.int32).to(paged.device))  # fmt: skip
    out = ops.paged_prefill_attention(*args, 0.125, None, 2.0, **kw(pool))
    want = ref_ops.paged_prefill_attention(*args, 0.125, None, 2.0, **kw(pool))
    paged.assert_close(out, want, torch.float32)


def test_int4_copy_blocks_copies_codes_and_both_scales(gen, paged):
    pool = int4_pool(6, 4, 2, 32, paged, layers=2)
    for t in (pool.k_cache, pool.v_cache):
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
    for t in (pool.k_scales, pool.v_scales):
        t.copy_(torch.randn(t.shape, generator=gen))
    tensors = (pool.k_cache, pool.v_cache, pool.k_scales, pool.v_scales)
    want = [t.clone() for t in tensors]
    pairs = [[1, 2], [2, 3], [3, 1]]  # a cycle: sources read before any write
    ref_ops.copy_blocks(want[0], want[1], pairs, k_scales=want[2], v_scales=want[3])
    ops.copy_blocks(pool.k_cache, pool.v_cache, pairs, k_scales=pool.k_scales, v_scales=pool.v_scales)
    for a, b in zip(tensors, want, strict=True):
        assert torch.equal(a, b)
