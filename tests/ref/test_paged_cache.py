"""PagedKVPool and its views: block allocation, page tables, views and copy-on-write,
for flat views (each seq_id's new tokens packed one after another)."""

from __future__ import annotations

import pytest
import torch

from paged_core import AttentionViewProtocol, OutOfBlocksError, ServingPoolProtocol
from paged_ref import PagedKVPool
from paged_ref.kv_spec import KVCacheSpec

HEADS, KV_HEADS, DIM, BS = 4, 2, 8, 16


def make_pool(num_blocks=12, block_size=BS, layers=2, prefix_caching=True, ops=None):
    return PagedKVPool.from_model_config(
        layers, KV_HEADS, DIM, num_blocks, block_size, torch.float32,
        enable_prefix_caching=prefix_caching, ops=ops,
    )  # fmt: skip


def kv(gen, num_tokens):
    """Flat K and V for ``num_tokens`` tokens: ``[num_tokens, kv_heads, head_dim]``."""
    shape = (num_tokens, KV_HEADS, DIM)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def token_at(pool, layer, seq_id, pos, cache="k"):
    """K (or V) of one token, ``[kv_heads, head_dim]``, read by hand through the
    block manager's page table (the oracle)."""
    block = pool.block_table(seq_id)[pos // pool.block_size]
    tensor = pool.k_cache if cache == "k" else pool.v_cache
    return tensor[layer, block, pos % pool.block_size]


def context(flat):
    """``[len, kv_heads, head_dim]`` as one seq_id of ``update``'s result."""
    return flat.transpose(0, 1).unsqueeze(0)


def prefill(pool, seq_id, length, gen):
    """Fill ``seq_id`` with ``length`` random tokens on every layer; returns K per layer."""
    view = pool.prefill_view(seq_id)
    written = []
    for layer in range(pool.num_layers):
        k, v = kv(gen, length)
        view.update(layer, k, v)
        written.append(k)
    view.advance(length)
    return written


# -- pool ---------------------------------------------------------------------
def test_sequence_allocation_takes_blocks_eagerly():
    pool = make_pool()
    seq_id = pool.allocate_seq(initial_tokens=50)
    assert len(pool.block_table(seq_id)) == 4  # ceil(50 / 16)
    assert pool.get_num_computed_tokens(seq_id) == 0 and pool.get_num_reserved(seq_id) == 50
    assert pool.free_seq_count() == 8
    empty = pool.allocate_seq(initial_tokens=0)  # a seq_id always holds room for one token
    assert len(pool.block_table(empty)) == 1 and pool.free_seq_count() == 7
    assert isinstance(pool, ServingPoolProtocol) and pool.is_paged()


def test_free_returns_only_that_sequences_blocks():
    pool = make_pool(num_blocks=100)
    seq_ids = [pool.allocate_seq(n) for n in (20, 100, 33)]
    assert [len(pool.block_table(s)) for s in seq_ids] == [2, 7, 3]
    assert pool.free_token_capacity() == (100 - 12) * BS
    middle = pool.block_table(seq_ids[1])
    pool.free_seq(seq_ids[1])
    assert pool.free_seq_count() == 100 - 5
    assert set(middle).isdisjoint(pool.block_table(seq_ids[0]) + pool.block_table(seq_ids[2]))
    with pytest.raises(KeyError):
        pool.get_num_computed_tokens(seq_ids[1])
    with pytest.raises(KeyError):
        pool.free_seq(999)
    assert pool.audit() == []


def test_free_token_capacity_counts_free_blocks():
    pool = make_pool(num_blocks=100)
    for _ in range(3):
        pool.allocate_seq(10 * BS)
    assert pool.free_token_capacity() == 70 * 16 == 1120


def test_exhaustion_leaves_no_partial_state():
    pool = make_pool(num_blocks=5)
    first = pool.allocate_seq(3 * BS)
    before = (pool.free_seq_count(), pool.block_manager.seq_ids(), pool.stats())
    with pytest.raises(OutOfBlocksError):
        pool.allocate_seq(3 * BS)
    with pytest.raises(RuntimeError):
        pool.allocate_sequence(list(range(3 * BS)))
    assert not pool.can_allocate_sequence(list(range(3 * BS)))
    assert (pool.free_seq_count(), pool.block_manager.seq_ids(), pool.stats()) == before
    assert pool.audit() == []
    later = pool.allocate_seq(2 * BS)
    assert later > first + 1  # failed attempts used up ids; none is handed out twice
    assert pool.free_seq_count() == 0


def test_audit_finds_and_reclaims_leaked_blocks():
    pool = make_pool(num_blocks=20)
    for n in (5, 17, 40):
        pool.allocate_seq(n)
    assert pool.audit() == []
    # a bug elsewhere took blocks from the pool and forgot them
    leaked = [b.block_id for b in pool.block_manager.block_pool.get_new_blocks(5)]
    assert pool.audit() != []
    free_before = pool.free_seq_count()
    assert sorted(pool.reclaim_leaked()) == sorted(leaked)
    assert pool.free_seq_count() == free_before + 5
    assert pool.audit() == []


def test_audit_reports_a_page_table_mirror_that_differs():
    pool = make_pool()
    seq_id = pool.allocate_seq(40)
    assert pool.audit() == []
    # Corrupt the mirror only: the block manager still holds the right table.
    pool.manager._tables[0].set(seq_id, 1, pool.block_table(seq_id)[0])
    assert any("page-table row" in p for p in pool.audit())


def test_block_size_one(gen):
    pool = make_pool(num_blocks=10, block_size=1)
    seq_id = pool.allocate_seq(5)
    assert len(pool.block_table(seq_id)) == 5
    ks = prefill(pool, seq_id, 5, gen)
    k, v = kv(gen, 1)
    pool.decode_view([seq_id]).update(0, k, v)
    assert len(pool.block_table(seq_id)) == 6
    for p in range(5):
        assert torch.equal(token_at(pool, 0, seq_id, p), ks[0][p])
    assert torch.equal(token_at(pool, 0, seq_id, 5), k[0])
    assert pool.audit() == []


# -- prefill views ------------------------------------------------------------
def test_single_sequence_prefill(gen):
    pool = make_pool()
    seq_id = pool.allocate_seq(32)
    view = pool.prefill_view(seq_id)
    assert isinstance(view, AttentionViewProtocol) and view.is_paged()
    k, v = kv(gen, 32)
    k_out, v_out = view.update(0, k, v)
    assert torch.equal(k_out, context(k)) and torch.equal(v_out, context(v))
    b0, b1 = pool.block_table(seq_id)
    assert torch.equal(pool.k_cache[0, b0], k[:16])
    assert torch.equal(pool.k_cache[0, b1], k[16:])
    assert torch.equal(pool.v_cache[0, b1], v[16:])
    assert pool.get_num_computed_tokens(seq_id) == 0  # nothing is committed before advance
    view.advance(32)
    assert pool.get_num_computed_tokens(seq_id) == 32 == view.seq_len


def test_cross_block_write_leaves_rest_of_block_untouched(gen):
    pool = make_pool()
    pool.k_cache.fill_(7.0)
    seq_id = pool.allocate_seq(40)
    k, v = kv(gen, 40)
    pool.prefill_view(seq_id).update(1, k, v)
    b0, b1, b2 = pool.block_table(seq_id)
    assert torch.equal(pool.k_cache[1, b0], k[:16])
    assert torch.equal(pool.k_cache[1, b1], k[16:32])
    assert torch.equal(pool.k_cache[1, b2, :8], k[32:])
    assert (pool.k_cache[1, b2, 8:] == 7.0).all()
    assert (pool.k_cache[0] == 7.0).all()  # other layer untouched


def test_packed_prefill_writes_exactly_its_tokens(gen):
    pool = make_pool()
    # Stale NaN in the blocks, as a reused block may hold.
    pool.k_cache.fill_(float("nan"))
    pool.v_cache.fill_(float("nan"))
    s0, s1 = pool.allocate_seq(10), pool.allocate_seq(20)
    assert pool.free_seq_count() == 12 - 3
    view = pool.batched_prefill_view([s0, s1], [10, 20])
    k, v = kv(gen, 30)  # seq_id 0's 10 tokens, then seq_id 1's 20
    k_out, v_out = view.update(0, k, v)
    (b0,) = pool.block_table(s0)
    assert torch.equal(pool.k_cache[0, b0, :10], k[:10])
    assert pool.k_cache[0, b0, 10:].isnan().all()  # nothing written past seq_id 0's tokens
    for p in range(20):
        assert torch.equal(token_at(pool, 0, s1, p), k[10 + p])
    # Each seq_id's context; zeros (not the stale NaN) past seq_id 0's length.
    assert k_out.shape == v_out.shape == (2, KV_HEADS, 20, DIM)
    assert torch.equal(k_out[0, :, :10], context(k[:10])[0])
    assert torch.equal(v_out[1], context(v[10:])[0])
    assert torch.equal(k_out[0, :, 10:], torch.zeros(KV_HEADS, 10, DIM))
    assert torch.equal(v_out[0, :, 10:], torch.zeros(KV_HEADS, 10, DIM))
    assert pool.free_seq_count() == 12 - 3  # the view took no block beyond the tokens
    view.advance()
    assert (pool.get_num_computed_tokens(s0), pool.get_num_computed_tokens(s1)) == (10, 20)


def test_kv_token_count_must_match_the_views_slots(gen):
    pool = make_pool()
    s0, s1 = pool.allocate_seq(10), pool.allocate_seq(20)
    view = pool.batched_prefill_view([s0, s1], [10, 20])
    before = pool.k_cache.clone()
    with pytest.raises(ValueError, match="40 tokens"):
        view.update(0, *kv(gen, 40))  # the old right-padded [2 x 20] batch
    with pytest.raises(ValueError, match="29 tokens"):
        view.attend(0, torch.randn(29, HEADS, DIM), *kv(gen, 29), scale=1.0)
    assert torch.equal(pool.k_cache, before)  # nothing written
    assert (pool.get_num_computed_tokens(s0), pool.get_num_computed_tokens(s1)) == (0, 0)
    with pytest.raises(ValueError, match="distinct"):
        pool.decode_view([s0, s0])


# -- decode views -------------------------------------------------------------
def test_single_decode_step(gen):
    pool = make_pool()
    seq_id = pool.allocate_seq(20)
    prefill(pool, seq_id, 20, gen)
    k, v = kv(gen, 1)
    k_all, v_all = pool.decode_view([seq_id]).update(0, k, v)
    table = pool.block_table(seq_id)
    assert torch.equal(pool.k_cache[0, table[1], 4], k[0])
    assert k_all.shape == v_all.shape == (1, KV_HEADS, 21, DIM)
    for p in range(21):
        assert torch.equal(k_all[0, :, p], token_at(pool, 0, seq_id, p))
        assert torch.equal(v_all[0, :, p], token_at(pool, 0, seq_id, p, "v"))


def test_multi_sequence_decode_at_exact_positions(gen):
    pool = make_pool()
    s0, s1 = pool.allocate_seq(10), pool.allocate_seq(30)
    prefill(pool, s0, 10, gen)
    prefill(pool, s1, 30, gen)
    view = pool.decode_view([s0, s1])
    assert view.seq_len == 30
    k, v = kv(gen, 2)
    k_all, _ = view.update(0, k, v)
    assert torch.equal(pool.k_cache[0, pool.block_table(s0)[0], 10], k[0])
    assert torch.equal(pool.k_cache[0, pool.block_table(s1)[1], 14], k[1])
    assert k_all.shape == (2, KV_HEADS, 31, DIM)
    for p in range(11):
        assert torch.equal(k_all[0, :, p], token_at(pool, 0, s0, p))
    assert torch.equal(k_all[0, :, 11:], torch.zeros(KV_HEADS, 20, DIM))
    for p in range(31):
        assert torch.equal(k_all[1, :, p], token_at(pool, 0, s1, p))
    view.advance(1)
    assert (pool.get_num_computed_tokens(s0), pool.get_num_computed_tokens(s1)) == (11, 31)


def test_vectorized_gather_equals_naive_loop(gen):
    pool = make_pool(num_blocks=30, block_size=4)
    lens = [3, 9, 4, 16]
    seq_ids = [pool.allocate_seq(n) for n in lens]
    for s, n in zip(seq_ids, lens, strict=True):
        prefill(pool, s, n, gen)
    view = pool.decode_view(seq_ids)
    for layer in range(pool.num_layers):
        k, v = kv(gen, len(seq_ids))
        k_all, v_all = view.update(layer, k, v)
        assert k_all.shape[2] == max(lens) + 1
        for i, (s, n) in enumerate(zip(seq_ids, lens, strict=True)):
            table = pool.block_table(s)
            naive_k = torch.stack(
                [pool.k_cache[layer, table[p // 4], p % 4] for p in range(n + 1)], 1
            )
            naive_v = torch.stack(
                [pool.v_cache[layer, table[p // 4], p % 4] for p in range(n + 1)], 1
            )
            assert torch.equal(k_all[i, :, : n + 1], naive_k)
            assert torch.equal(v_all[i, :, : n + 1], naive_v)
            assert not k_all[i, :, n + 1 :].any() and not v_all[i, :, n + 1 :].any()


def test_step_metadata_is_built_once_and_reused_by_every_layer(gen, monkeypatch):
    pool = make_pool()
    seq_ids = [pool.allocate_seq(5), pool.allocate_seq(18)]
    for s, n in zip(seq_ids, [5, 18], strict=True):
        prefill(pool, s, n, gen)
    builds = []
    build = pool.build_metadata
    monkeypatch.setattr(pool, "build_metadata", lambda *a: builds.append(a) or build(*a))
    view = pool.decode_view(seq_ids)
    q = torch.randn(2, HEADS, DIM, generator=gen)
    view.attend(0, q, *kv(gen, 2), scale=0.5)
    meta = view.meta
    plans = dict(meta.memo)
    assert plans  # layer 0 left its gather plan for the other layers
    view.attend(1, q, *kv(gen, 2), scale=0.5)
    assert view.meta is meta and len(builds) == 1
    assert meta.memo.keys() == plans.keys()
    assert all(meta.memo[key] is plan for key, plan in plans.items())
    # The next pass (same counts) builds its metadata once more, not per layer.
    view.advance(1)
    pool.append_token(seq_ids[0], 0)
    pool.append_token(seq_ids[1], 0)
    for layer in range(pool.num_layers):
        view.attend(layer, q, *kv(gen, 2), scale=0.5)
    assert len(builds) == 2 and view.meta is not meta


def test_decode_grows_a_block_lazily_and_fails_cleanly_when_full(gen):
    pool = make_pool(num_blocks=2)
    seq_id = pool.allocate_seq(16)
    prefill(pool, seq_id, 16, gen)
    free_before = pool.free_seq_count()
    k, v = kv(gen, 1)
    pool.decode_view([seq_id]).update(0, k, v)
    assert pool.free_seq_count() == free_before - 1
    assert torch.equal(pool.k_cache[0, pool.block_table(seq_id)[1], 0], k[0])

    full = make_pool(num_blocks=1)
    only = full.allocate_seq(16)
    prefill(full, only, 16, gen)
    assert not full.can_append([only])
    with pytest.raises(OutOfBlocksError):
        full.decode_view([only]).update(0, *kv(gen, 1))
    assert (full.get_num_computed_tokens(only), full.get_num_reserved(only)) == (16, 16)
    assert full.audit() == []


def test_step_view_requires_room_reserved_first(gen):
    pool = make_pool()
    seq_id, _ = pool.allocate_sequence(list(range(BS)))
    with pytest.raises(RuntimeError, match="reserve first"):
        pool.step_view([seq_id], [0], [BS + 1])  # one token past the prompt
    blocks = pool.block_table(seq_id)
    view = pool.step_view([seq_id], [0], [BS])
    view.update(0, *kv(gen, BS))
    view.advance()
    with pytest.raises(RuntimeError, match="reserve first"):
        pool.step_view([seq_id], [BS], [1])  # a decode before append_token
    assert pool.block_table(seq_id) == blocks  # the strict view took no block
    pool.append_token(seq_id, 5)
    k, v = kv(gen, 1)
    pool.step_view([seq_id], [BS], [1]).update(0, k, v)
    assert torch.equal(token_at(pool, 0, seq_id, BS), k[0])
    assert pool.audit() == []


@pytest.mark.parametrize(
    ("prompt", "block", "offset"), [(BS - 1, 0, BS - 1), (BS, 1, 0), (2 * BS, 2, 0)]
)
def test_decode_at_block_boundaries(prompt, block, offset, gen):
    pool = make_pool()
    seq_id, cached = pool.allocate_sequence(list(range(prompt)))
    assert cached == 0
    prefill(pool, seq_id, prompt, gen)
    pool.append_token(seq_id, 1)
    assert len(pool.block_table(seq_id)) == block + 1
    k, v = kv(gen, 1)
    view = pool.decode_view([seq_id])
    view.update(0, k, v)
    assert len(pool.block_table(seq_id)) == block + 1  # append_token already reserved it
    assert torch.equal(pool.k_cache[0, pool.block_table(seq_id)[block], offset], k[0])
    view.advance(1)
    assert pool.get_num_computed_tokens(seq_id) == prompt + 1


def test_decode_after_batched_prefill(gen):
    pool = make_pool()
    s0, s1 = pool.allocate_seq(5), pool.allocate_seq(10)
    view = pool.batched_prefill_view([s0, s1], [5, 10])
    view.update(0, *kv(gen, 15))
    view.advance(10)
    dec = pool.decode_view([s0, s1])
    assert dec.seq_len == 10
    k, v = kv(gen, 2)
    dec.update(0, k, v)
    assert torch.equal(token_at(pool, 0, s0, 5), k[0])
    assert torch.equal(token_at(pool, 0, s1, 10), k[1])
    # The same view runs the next decode step after a commit.
    dec.advance(1)
    k, v = kv(gen, 2)
    dec.update(0, k, v)
    assert torch.equal(token_at(pool, 0, s0, 6), k[0])
    assert torch.equal(token_at(pool, 0, s1, 11), k[1])
    dec.advance(1)
    assert (pool.get_num_computed_tokens(s0), pool.get_num_computed_tokens(s1)) == (7, 12)


# -- serving pool -------------------------------------------------------------
def test_fork_shares_blocks_and_copies_on_write(gen):
    pool = make_pool()
    parent, _ = pool.allocate_sequence(list(range(20)))
    ks = prefill(pool, parent, 20, gen)
    child = pool.fork_seq(parent)
    assert pool.block_table(child) == pool.block_table(parent)
    assert pool.get_num_computed_tokens(child) == 20
    shared = pool.block_table(parent)[1]
    parent_block = pool.k_cache[:, shared].clone()
    pool.append_token(child, 3)  # last block is shared: child gets a copy
    assert pool.block_table(child)[1] != shared
    assert pool.stats()["cow_copies"] == 1
    k, v = kv(gen, 1)
    pool.decode_view([child]).update(0, k, v)  # runs the deferred copy first
    for layer in range(pool.num_layers):
        for p in range(20):
            assert torch.equal(token_at(pool, layer, child, p), ks[layer][p])
    assert torch.equal(token_at(pool, 0, child, 20), k[0])
    assert torch.equal(pool.k_cache[:, shared], parent_block)  # parent's block untouched
    assert pool.audit() == []
    pool.free_seq(parent)
    pool.free_seq(child)
    assert pool.audit() == [] and pool.stats()["blocks_used"] == 0


def assert_views_use_block_manager_tables(pool, seq_ids):
    """The audit (mirror vs block manager) and the tables a view hands the ops."""
    assert pool.audit() == []
    starts = [pool.get_num_reserved(s) - 1 for s in seq_ids]
    meta = pool.build_metadata(seq_ids, starts, [1] * len(seq_ids))
    for row, seq_id in zip(meta.block_tables.tolist(), seq_ids, strict=True):
        table = pool.block_table(seq_id)
        assert row[: len(table)] == table


def test_page_table_mirror_follows_growth_fork_and_free():
    pool = make_pool(num_blocks=20, block_size=4)
    a, _ = pool.allocate_sequence(list(range(8)))
    b, _ = pool.allocate_sequence(list(range(8)))  # no hit: nothing was computed yet
    assert_views_use_block_manager_tables(pool, [a, b])
    for t in range(5):  # across a block boundary
        pool.append_token(a, t)
    assert_views_use_block_manager_tables(pool, [a, b])
    child = pool.fork_seq(b)  # b's last block is full: appends take fresh blocks
    pool.append_token(child, 1)
    pool.append_token(b, 2)
    assert pool.stats()["cow_copies"] == 0
    assert_views_use_block_manager_tables(pool, [a, b, child])
    pool.free_seq(b)
    assert_views_use_block_manager_tables(pool, [a, child])
    pool.mark_computed(a, 13)
    c, cached = pool.allocate_sequence(list(range(8)) + [0, 1, 2, 3, 9])  # a prefix hit
    assert cached == 12
    assert_views_use_block_manager_tables(pool, [child, c, a])


def test_page_table_mirror_follows_copy_on_write():
    pool = make_pool(num_blocks=20, block_size=4)
    parent, _ = pool.allocate_sequence(list(range(6)))
    child = pool.fork_seq(parent)
    pool.append_token(child, 1)  # shared half-full block: copied
    assert pool.stats()["cow_copies"] == 1
    assert_views_use_block_manager_tables(pool, [parent, child])


class RecordingOps:
    """An ``ops`` module stand-in that counts calls and delegates to paged_ref.ops."""

    def __init__(self):
        from paged_ref import ops

        self.calls: list[str] = []
        for name in (
            "write_kv",
            "paged_decode_attention",
            "paged_prefill_attention",
            "copy_blocks",
        ):
            setattr(self, name, self._wrap(name, getattr(ops, name)))

    def _wrap(self, name, fn):
        def call(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)

        return call


def test_views_and_cow_go_through_the_pools_ops(gen):
    rec = RecordingOps()
    pool = PagedKVPool.from_model_config(1, KV_HEADS, DIM, 8, 4, torch.float32, ops=rec)
    seq_id, _ = pool.allocate_sequence([1, 2, 3])
    view = pool.prefill_view(seq_id)
    view.attend(0, torch.randn(3, HEADS, DIM), *kv(gen, 3), scale=1.0)
    view.advance()
    children = [pool.fork_seq(seq_id), pool.fork_seq(seq_id)]
    for child in children:
        pool.append_token(child, 4)
    pool.decode_view(children).attend(
        0, torch.randn(2, HEADS, DIM), *kv(gen, 2), scale=1.0
    )  # fmt: skip
    assert rec.calls == [
        "write_kv", "paged_prefill_attention", "copy_blocks", "write_kv", "paged_decode_attention",
    ]  # fmt: skip  # both children's copies in one batched call


def test_paged_ref_never_imports_triton():
    import subprocess
    import sys

    code = "import sys, paged_ref; assert 'triton' not in sys.modules, 'triton was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sizing_helpers_and_kv_bytes():
    pool = PagedKVPool.from_model_config(3, 2, 8, 10, 4, torch.float16, device="meta")
    per_block = 2 * 3 * 2 * 4 * 8 * 2
    assert pool.kv_bytes() == 10 * per_block
    assert tuple(pool.k_cache.shape) == (3, 10, 4, 2, 8)  # [layers, blocks, block, kv_heads, dim]
    spec = KVCacheSpec.dense(3, 2, 8, torch.float16, block_size=4)
    assert spec.block_bytes() == per_block and spec.token_bytes() * 4 == per_block
    assert spec.blocks_in(10 * per_block + per_block - 1) == 10
