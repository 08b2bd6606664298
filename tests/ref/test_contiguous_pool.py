"""ContiguousKVPool and its views: allocate, free, lengths and views,
generalized to sequences whose new tokens start at their current length, for
flat views (each seq_id's new tokens packed one after another)."""

from __future__ import annotations

import pytest
import torch

from paged_core import AttentionViewProtocol, OutOfBlocksError, ServingPoolProtocol
from paged_ref import ContiguousKVPool

HEADS, KV_HEADS, DIM = 4, 2, 8


def make_pool(max_batch_size=6, max_model_len=256, layers=2) -> ContiguousKVPool:
    return ContiguousKVPool.from_model_config(
        layers, KV_HEADS, DIM, max_model_len, max_batch_size, dtype=torch.float32
    )


def kv(gen, num_tokens):
    """Flat K and V for ``num_tokens`` tokens: ``[num_tokens, kv_heads, head_dim]``."""
    shape = (num_tokens, KV_HEADS, DIM)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def context(flat):
    """``[len, kv_heads, head_dim]`` as one seq_id of ``update``'s result."""
    return flat.transpose(0, 1).unsqueeze(0)


def test_slot_allocation_and_exhaustion():
    pool = make_pool(max_batch_size=3)
    seq_ids = [pool.allocate_seq() for _ in range(3)]
    assert sorted(seq_ids) == [0, 1, 2]
    assert pool.free_seq_count() == 0
    with pytest.raises(RuntimeError, match="seq_ids are in use"):
        pool.allocate_seq()
    with pytest.raises(OutOfBlocksError):
        pool.allocate_sequence([1, 2, 3])
    pool.free_seq(seq_ids[1])
    assert pool.free_seq_count() == 1
    assert pool.allocate_seq() == seq_ids[1]
    with pytest.raises(KeyError):
        pool.free_seq(7)


def test_prefill_view_writes_slot_rows(gen):
    pool = make_pool()
    for _ in range(4):
        pool.allocate_seq()
    k, v = kv(gen, 12)
    view = pool.prefill_view(3)
    assert view.seq_len == 0
    k_out, v_out = view.update(1, k, v)
    assert torch.equal(k_out, context(k)) and torch.equal(v_out, context(v))
    assert torch.equal(pool.k[1, 3, :12], k)
    assert torch.equal(pool.v[1, 3, :12], v)
    assert pool.k[0].abs().sum() == 0  # other layers untouched
    assert pool.seq_lens[3] == 0  # nothing is committed before advance
    view.advance(12)
    assert view.seq_len == 12
    assert pool.seq_lens[3] == 12 == pool.get_num_computed_tokens(3)


def _prefill(pool, seq_id, length, gen):
    """Fill ``seq_id`` with ``length`` random tokens on every layer."""
    view = pool.prefill_view(seq_id)
    for layer in range(pool.num_layers):
        view.update(layer, *kv(gen, length))
    view.advance(length)


def test_decode_view_writes_at_each_row_length(gen):
    pool = make_pool()
    for _ in range(6):
        pool.allocate_seq()
    for seq_id, n in [(0, 100), (2, 50), (5, 200)]:
        _prefill(pool, seq_id, n, gen)
    view = pool.decode_view([0, 2, 5])
    assert view.seq_len == 200
    k, v = kv(gen, 3)
    k_all, v_all = view.update(0, k, v)
    for i, (seq_id, pos) in enumerate([(0, 100), (2, 50), (5, 200)]):
        assert torch.equal(pool.k[0, seq_id, pos], k[i])
        assert torch.equal(pool.v[0, seq_id, pos], v[i])
        assert torch.equal(k_all[i, :, : pos + 1], pool.k[0, seq_id, : pos + 1].transpose(0, 1))
        assert not k_all[i, :, pos + 1 :].any()  # zeros past the seq_id's length
    assert k_all.shape == v_all.shape == (3, KV_HEADS, 201, DIM)
    view.advance(1)
    assert [pool.seq_lens[s] for s in (0, 2, 5)] == [101, 51, 201]


def test_decode_view_single_slot(gen):
    pool = make_pool()
    for _ in range(3):
        pool.allocate_seq()
    _prefill(pool, 2, 75, gen)
    view = pool.decode_view([2])
    assert view.seq_len == 75
    k, v = kv(gen, 1)
    k_all, _ = view.update(0, k, v)
    assert k_all.shape == (1, KV_HEADS, 76, DIM)
    assert torch.equal(k_all[0, :, 75], k[0])
    # The same view runs the next decode step after a commit.
    view.advance(1)
    k, v = kv(gen, 1)
    k_all, _ = view.update(0, k, v)
    assert k_all.shape == (1, KV_HEADS, 77, DIM) and torch.equal(pool.k[0, 2, 76], k[0])


def test_packed_prefill_writes_exactly_its_tokens(gen):
    pool = make_pool()
    # Stale NaN in the rows, as a reused seq_id may hold.
    pool.k.fill_(float("nan"))
    pool.v.fill_(float("nan"))
    for _ in range(3):
        pool.allocate_seq()
    view = pool.batched_prefill_view([0, 2], [10, 20])
    assert isinstance(view, AttentionViewProtocol)
    assert not view.is_paged()
    k, v = kv(gen, 30)  # seq_id 0's 10 tokens, then seq_id 2's 20
    k_out, v_out = view.update(0, k, v)
    assert torch.equal(pool.k[0, 0, :10], k[:10])
    assert pool.k[0, 0, 10:].isnan().all()  # nothing written past seq_id 0's tokens
    assert pool.k[0, 1].isnan().all()  # nor into a seq_id outside the view
    assert torch.equal(pool.k[0, 2, :20], k[10:])
    assert torch.equal(pool.v[0, 2, :20], v[10:])
    assert k_out.shape == v_out.shape == (2, KV_HEADS, 20, DIM)
    # Each seq_id's context; zeros (not the stale NaN) past seq_id 0's length.
    assert torch.equal(k_out[0, :, :10], context(k[:10])[0])
    assert torch.equal(k_out[0, :, 10:], torch.zeros(KV_HEADS, 10, DIM))
    assert torch.equal(v_out[0, :, 10:], torch.zeros(KV_HEADS, 10, DIM))
    assert torch.equal(v_out[1], context(v[10:])[0])
    view.advance()
    assert pool.seq_lens[0] == 10 and pool.seq_lens[2] == 20


def test_kv_token_count_must_match_the_views_slots(gen):
    pool = make_pool()
    for _ in range(2):
        pool.allocate_seq()
    view = pool.batched_prefill_view([0, 1], [10, 20])
    with pytest.raises(ValueError, match="40 tokens"):
        view.update(0, *kv(gen, 40))  # the old right-padded [2 x 20] batch
    with pytest.raises(ValueError, match="29 tokens"):
        view.attend(0, torch.randn(29, HEADS, DIM), *kv(gen, 29), scale=1.0)
    assert pool.k.abs().sum() == 0 and pool.seq_lens[:2] == [0, 0]  # nothing written


def test_batched_prefill_overflow_is_rejected(gen):
    pool = make_pool(max_model_len=16)
    seq_id = pool.allocate_seq()
    _prefill(pool, seq_id, 10, gen)
    # The views reserve through append_token, which refuses past max_model_len.
    with pytest.raises(OutOfBlocksError, match="max_model_len"):
        pool.batched_prefill_view([seq_id], [8]).update(0, *kv(gen, 8))
    assert pool.seq_lens[seq_id] == 10
    with pytest.raises(OutOfBlocksError, match="max_model_len"):
        pool.prefill_view(seq_id).update(0, *kv(gen, 7))  # count taken from k
    assert pool.seq_lens[seq_id] == 10 and pool.audit() == []
    with pytest.raises(ValueError, match="max_model_len"):
        pool.step_view([seq_id], [10], [7])


def test_decode_after_batched_prefill(gen):
    pool = make_pool()
    for _ in range(2):
        pool.allocate_seq()
    view = pool.batched_prefill_view([0, 1], [5, 10])
    view.update(0, *kv(gen, 15))
    view.advance(10)
    dec = pool.decode_view([0, 1])
    assert dec.seq_len == 10
    k, v = kv(gen, 2)
    dec.update(0, k, v)
    assert torch.equal(pool.k[0, 0, 5], k[0])
    assert torch.equal(pool.k[0, 1, 10], k[1])
    dec.advance(1)
    assert pool.seq_lens[:2] == [6, 11]


def test_slot_reuse_starts_from_zero(gen):
    pool = make_pool()
    seq_id = pool.allocate_seq()
    _prefill(pool, seq_id, 50, gen)
    pool.free_seq(seq_id)
    assert pool.allocate_seq() == seq_id
    k, v = kv(gen, 30)
    view = pool.prefill_view(seq_id)
    k_all, _ = view.update(0, k, v)
    assert torch.equal(k_all, context(k))  # the old sequence's rows 30..49 are not read
    view.advance(30)
    assert pool.seq_lens[seq_id] == 30
    assert torch.equal(pool.k[0, seq_id, :30], k)


@pytest.mark.parametrize("window", [None, 4])
def test_packed_attend_matches_sdpa_per_row(window, gen, helpers):
    pool = make_pool()
    seq_ids = [pool.allocate_seq() for _ in range(3)]
    lens = [7, 3, 9]
    q = torch.randn(sum(lens), HEADS, DIM, generator=gen)
    k, v = kv(gen, sum(lens))
    out = pool.batched_prefill_view(seq_ids, lens).attend(
        0, q, k, v, scale=0.4, sliding_window=window
    )
    assert out.shape == q.shape  # one row per token: no padding rows
    lo = 0
    for n in lens:
        rows = slice(lo, lo + n)
        ref = helpers.sdpa_oracle(
            q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1), 0, 0.4,
            window,
        )  # fmt: skip
        torch.testing.assert_close(out[rows].transpose(0, 1), ref, atol=1e-5, rtol=1e-5)
        lo += n


@pytest.mark.parametrize("window", [None, 5])
def test_chunked_prefill_and_decode_equal_one_full_prefill(window, gen):
    pool = make_pool(max_batch_size=2, max_model_len=64)
    full, chunked = pool.allocate_seq(), pool.allocate_seq()
    n = 14
    q = torch.randn(n, HEADS, DIM, generator=gen)
    k, v = kv(gen, n)
    whole = pool.prefill_view(full).attend(0, q, k, v, scale=0.3, sliding_window=window)
    pieces = []
    for lo, hi in [(0, 5), (5, 6), (6, 13)]:
        view = pool.prefill_view(chunked)
        pieces.append(
            view.attend(0, q[lo:hi], k[lo:hi], v[lo:hi], scale=0.3, sliding_window=window)
        )
        view.advance(hi - lo)
    dec = pool.decode_view([chunked])
    pieces.append(dec.attend(0, q[13:], k[13:], v[13:], scale=0.3, sliding_window=window))
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-6, rtol=1e-6)


def test_serving_pool_protocol(gen):
    pool = make_pool(max_batch_size=2, max_model_len=8)
    assert isinstance(pool, ServingPoolProtocol)
    assert pool.free_token_capacity() is None
    assert not pool.can_allocate_sequence(list(range(9)))
    seq_id, cached = pool.allocate_sequence(list(range(6)))
    assert cached == 0 and pool.get_num_computed_tokens(seq_id) == 0
    assert pool.stats()["usage"] == pytest.approx(6 / 16)
    _prefill(pool, seq_id, 6, gen)
    pool.append_token(seq_id, 11)
    assert pool.can_append([seq_id])
    pool.append_token(seq_id, 12)
    assert not pool.can_append([seq_id])
    with pytest.raises(OutOfBlocksError, match="max_model_len"):
        pool.append_token(seq_id, 13)
    child = pool.fork_seq(seq_id)
    assert child != seq_id and pool.get_num_computed_tokens(child) == 6
    assert torch.equal(pool.k[:, child, :6], pool.k[:, seq_id, :6])
    assert pool.audit() == []
    pool.free_seq(child)
    pool.seq_lens[child] = 4
    assert any("free seq_id" in p for p in pool.audit())


def test_step_view_requires_room_reserved_first(gen):
    pool = make_pool(max_model_len=16)
    seq_id, _ = pool.allocate_sequence(list(range(6)))
    with pytest.raises(RuntimeError, match="reserve first"):
        pool.step_view([seq_id], [0], [7])  # one token past the prompt
    view = pool.step_view([seq_id], [0], [6])
    view.update(0, *kv(gen, 6))
    view.advance()
    with pytest.raises(RuntimeError, match="reserve first"):
        pool.step_view([seq_id], [6], [1])  # a decode before append_token
    assert pool.get_num_reserved(seq_id) == 6  # the strict view reserved nothing
    pool.append_token(seq_id, 5)
    k, v = kv(gen, 1)
    pool.step_view([seq_id], [6], [1]).update(0, k, v)
    assert torch.equal(pool.k[0, seq_id, 6], k[0])
    assert pool.audit() == []


def test_kv_bytes_counts_both_tensors():
    pool = ContiguousKVPool.from_model_config(3, 2, 8, 16, 4, dtype=torch.float16, device="meta")
    assert pool.kv_bytes() == 2 * 3 * 4 * 2 * 16 * 8 * 2
    assert tuple(pool.k.shape) == (3, 4, 16, 2, 8)  # [layers, seq_ids, max_model_len, kv_heads, dim]
