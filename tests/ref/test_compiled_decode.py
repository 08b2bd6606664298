"""The compiled in-place decode (``paged_ref.compiled_decode``) against the
reference ``paged_decode_attention`` on random page tables: stale and NaN
blocks, zero-length sequences, sliding windows, soft-capping, GQA; one
graph serves every batch size and table width (sizes 1 included), and
8-bit caches fall back to the reference."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from paged_ref import ops
from paged_ref.compiled_decode import CompiledDecodeOps, compiled_decode_attention
from paged_ref.kv_quant import quantize

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 4
NUM_BLOCKS = 64


def random_batch(gen: torch.Generator, batch: int, max_len: int, dtype: torch.dtype):
    """A batch whose tables point at random distinct blocks; entries past a
    sequence's blocks are junk (-1 or out of range) and one unused block is NaN."""
    lens = torch.randint(0, max_len + 1, (batch,), generator=gen)
    lens[0] = max_len
    width = max(1, -(-max_len // BLOCK))
    tables = torch.randint(-1, NUM_BLOCKS + 8, (batch, width), generator=gen, dtype=torch.int32)
    order = torch.randperm(NUM_BLOCKS - 1, generator=gen)
    used = 0
    for b in range(batch):
        n = -(-int(lens[b]) // BLOCK)
        tables[b, :n] = order[used : used + n].int()
        used += n
    k = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    k[NUM_BLOCKS - 1] = v[NUM_BLOCKS - 1] = float("nan")  # stale, reachable only through junk entries
    tables[tables == NUM_BLOCKS - 1] = 0
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    return q, k, v, tables, lens


@pytest.mark.parametrize(
    ("dtype", "window", "softcap", "atol"),
    [(torch.float32, None, None, 1e-5), (torch.bfloat16, 6, None, 2e-2), (torch.float32, None, 5.0, 1e-5)],
)
def test_compiled_decode_matches_the_reference(dtype, window, softcap, atol) -> None:
    gen = torch.Generator().manual_seed(0)
    graphs = None
    for batch, max_len in [(1, 1), (1, 9), (5, 4), (7, 23), (12, 40), (3, 0)]:
        q, k, v, tables, lens = random_batch(gen, batch, max_len, dtype)
        want = ops.paged_decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5, window, softcap)
        got = compiled_decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5, window, softcap)
        assert got.dtype == q.dtype and got.shape == q.shape
        assert not got.isnan().any()
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
        if graphs is None:  # the first call compiles; no batch or width after it does
            graphs = counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs, (batch, max_len)


def test_quantized_caches_take_the_reference_path() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v, tables, lens = random_batch(gen, 4, 13, torch.float32)
    (k8, ks), (v8, vs) = quantize(k, torch.int8), quantize(v, torch.int8)
    args = (q, k8, v8, tables, lens, HEAD_DIM**-0.5)
    want = ops.paged_decode_attention(*args, k_scales=ks, v_scales=vs)
    got = CompiledDecodeOps(ops).paged_decode_attention(*args, k_scales=ks, v_scales=vs)
    assert torch.equal(got, want)
    assert CompiledDecodeOps(ops).write_kv is ops.write_kv  # every other op is the wrapped module's
