"""Triton write_kv and copy_blocks against paged_ref.ops: both only move
data, so the caches must come out bit-identical."""

from __future__ import annotations

import types

import pytest
import torch

from paged_ref import PagedKVPool
from paged_ref import ops as ref_ops
from paged_triton import ops


@pytest.mark.parametrize(("kv_heads", "head_dim", "block_size"), [(2, 64, 16), (3, 80, 8)])
def test_write_kv_matches_reference(kv_heads, head_dim, block_size, dtype, gen, paged):
    num_blocks, tokens = 12, 20
    k_cache, v_cache = paged.random_caches(num_blocks, kv_heads, block_size, head_dim, dtype, gen)
    # K and V as slices of one fused projection (not contiguous), in float32:
    # the op must follow the strides and cast to the cache dtype.
    fused = torch.randn(tokens, 3 * kv_heads, head_dim, generator=gen).to(paged.device)
    k, v = fused[:, kv_heads : 2 * kv_heads], fused[:, 2 * kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[0, 7, 19]] = -1  # padding rows of a right-padded batch
    slots = slots.to(paged.device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    ref_ops.write_kv(expected_k, expected_v, k, v, slots)
    ops.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_write_kv_with_only_padding_changes_nothing(gen, paged):
    k_cache, v_cache = paged.random_caches(4, 2, 8, 32, torch.float32, gen)
    before = k_cache.clone()
    new = torch.randn(3, 2, 32, generator=gen).to(paged.device)
    ops.write_kv(k_cache, v_cache, new, new, torch.full((3,), -1, device=paged.device))
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize(
    "pairs",
    [
        pytest.param([[1, 4], [2, 5], [1, 6]], id="fork-one-source-twice"),
        pytest.param([[1, 2], [2, 3], [3, 1]], id="destinations-are-sources"),
        pytest.param([], id="nothing"),
    ],
)
@pytest.mark.parametrize("form", ["list", "cpu-tensor"])
def test_copy_blocks_matches_reference(pairs, form, dtype, gen, paged):
    """Both ops take the step's pairs from the host: a list or a CPU tensor."""
    shape = (3, 8, 16, 2, 48)  # layers, blocks, block_size, kv_heads, head_dim
    k_caches = torch.randn(shape, generator=gen).to(paged.device, dtype)
    v_caches = torch.randn(shape, generator=gen).to(paged.device, dtype)
    src_to_dst = [tuple(p) for p in pairs]
    if form == "cpu-tensor":
        src_to_dst = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
    before = k_caches.clone()
    expected_k, expected_v = k_caches.clone(), v_caches.clone()
    ref_ops.copy_blocks(expected_k, expected_v, src_to_dst)
    ops.copy_blocks(k_caches, v_caches, src_to_dst)
    assert torch.equal(k_caches, expected_k) and torch.equal(v_caches, expected_v)
    for src, dst in pairs:  # every source was read before any destination was written
        assert torch.equal(k_caches[:, dst], before[:, src])


def test_copy_blocks_rejects_ids_outside_the_pool(gen, paged):
    caches = torch.zeros(1, 4, 1, 8, 16, device=paged.device)
    with pytest.raises(ValueError, match="outside"):
        ops.copy_blocks(caches, caches.clone(), [(0, 4)])


def test_pool_flushes_copy_on_write_as_host_pairs(gen, paged):
    """The paged pool hands a step's copy-on-writes to ``copy_blocks`` as one
    host list (one upload, no read-back), and the copy lands."""
    seen = []

    def recording_copy_blocks(k_caches, v_caches, src_to_dst):
        seen.append(src_to_dst)
        ops.copy_blocks(k_caches, v_caches, src_to_dst)

    spy = types.SimpleNamespace(**{name: getattr(ops, name) for name in ops.__all__})
    spy.copy_blocks = recording_copy_blocks
    pool = PagedKVPool.from_model_config(
        2, 2, 32, 8, 4, torch.float32, device=paged.device, ops=spy
    )
    pool.k_cache.copy_(torch.randn(pool.k_cache.shape, generator=gen))
    parents = [pool.allocate_sequence([t, 2, 3, 4, 5, 6])[0] for t in (1, 9)]
    for parent in parents:
        pool.mark_computed(parent, 6)
    children = [pool.fork_seq(p) for p in parents]
    for child in children:
        pool.append_token(child, 7)  # each shares its parent's half-full block: copy-on-write
    pool.step_view(children, [6, 6], [1, 1])  # the step flushes the pending copies
    assert len(seen) == 1 and isinstance(seen[0], list) and len(seen[0]) == 2
    for parent, child in zip(parents, children, strict=True):
        src, dst = pool.block_table(parent)[1], pool.block_table(child)[1]
        assert (src, dst) in seen[0] and torch.equal(pool.k_cache[:, dst], pool.k_cache[:, src])
