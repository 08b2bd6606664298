"""Queries attending to cached context: prefix-cache hits and chunked prefill
in the paged pool (with the backend's ops) give the same attention outputs as
one full prefill of the same prompt in the contiguous pool."""

from __future__ import annotations

import pytest
import torch

from paged_ref import ContiguousKVPool, PagedKVPool

pytestmark = pytest.mark.backend

LAYERS, HEADS, KV_HEADS, DIM, BLOCK, VOCAB = 2, 8, 2, 16, 4, 50


class FakeModel:
    """Q/K/V that depend only on (layer, token id, position), like a real
    model's first layer, so one prompt's prefix has the same K/V wherever it
    is computed."""

    def __init__(self, gen, max_len=64):
        def table(heads):
            tok = torch.randn(LAYERS, VOCAB, heads, DIM, generator=gen)
            pos = torch.randn(LAYERS, max_len, heads, DIM, generator=gen)
            return tok, pos

        self.tables = [table(HEADS), table(KV_HEADS), table(KV_HEADS)]

    def qkv(self, layer, tokens, start):
        """``[len, heads, D]`` q/k/v for ``tokens`` at positions ``start..``."""
        ids = torch.tensor(tokens, dtype=torch.long)
        pos = torch.arange(start, start + len(tokens))
        return [tok[layer, ids] + p[layer, pos] for tok, p in self.tables]


def run(view, model, tokens_per_row, starts, window=None):
    """attend on every layer for a flat batch (each row's tokens after the
    previous row's), then commit; returns each layer's ``[num_tokens, heads, D]``."""
    outs = []
    for layer in range(LAYERS):
        parts = [
            model.qkv(layer, toks, start)
            for toks, start in zip(tokens_per_row, starts, strict=True)
        ]
        q, k, v = (torch.cat(x) for x in zip(*parts, strict=True))
        outs.append(view.attend(layer, q, k, v, scale=DIM**-0.5, sliding_window=window))
    view.advance(len(tokens_per_row[0]))  # the count matters only to prefill_view
    return outs


@pytest.fixture
def new_pool(paged_ops):
    def make(prefix_caching=True):
        return PagedKVPool.from_model_config(
            LAYERS, KV_HEADS, DIM, 32, BLOCK, torch.float32,
            enable_prefix_caching=prefix_caching, ops=paged_ops,
        )  # fmt: skip

    return make


def full_prefill(model, tokens, window=None):
    """The oracle: one prefill of the whole prompt in the contiguous pool."""
    pool = ContiguousKVPool.from_model_config(LAYERS, KV_HEADS, DIM, 64, 1, dtype=torch.float32)
    seq_id, _ = pool.allocate_sequence(tokens)
    return run(pool.prefill_view(seq_id), model, [tokens], [0], window)


@pytest.mark.parametrize("window", [None, 3])
def test_prefix_hit_equals_full_prefill(window, gen, new_pool, paged_atol):
    model = FakeModel(gen)
    shared = torch.randint(1, VOCAB, (2 * BLOCK,), generator=gen).tolist()
    first = shared + [5, 6, 7]
    second = shared + [9, 8, 7, 6, 5]

    pool = new_pool()
    seq_id_a, cached_a = pool.allocate_sequence(first)
    assert cached_a == 0
    run(pool.prefill_view(seq_id_a), model, [first], [0], window)
    seq_id_b, cached_b = pool.allocate_sequence(second)
    assert cached_b == 2 * BLOCK
    assert pool.get_num_computed_tokens(seq_id_b) == cached_b
    assert pool.block_table(seq_id_b)[:2] == pool.block_table(seq_id_a)[:2]
    view = pool.prefill_view(seq_id_b)
    assert view.seq_len == cached_b
    got = run(view, model, [second[cached_b:]], [cached_b], window)
    want = full_prefill(model, second, window)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w[cached_b:], atol=paged_atol, rtol=0)
    assert pool.get_num_computed_tokens(seq_id_b) == len(second)
    assert pool.stats()["prefix_hits_tokens"] == cached_b
    assert pool.audit() == []


def test_update_returns_cached_context_after_a_prefix_hit(gen, new_pool, paged_atol):
    model = FakeModel(gen)
    prompt = torch.randint(1, VOCAB, (3 * BLOCK,), generator=gen).tolist()
    pool = new_pool()
    seq_id_a, _ = pool.allocate_sequence(prompt)
    run(pool.prefill_view(seq_id_a), model, [prompt], [0])
    seq_id_b, cached = pool.allocate_sequence(prompt)
    assert cached == 2 * BLOCK  # the block holding the last token is always computed
    _, k, v = model.qkv(0, prompt[cached:], cached)
    k_all, v_all = pool.prefill_view(seq_id_b).update(0, k, v)
    _, k_full, v_full = model.qkv(0, prompt, 0)
    assert torch.equal(k_all, k_full.transpose(0, 1).unsqueeze(0))
    assert torch.equal(v_all, v_full.transpose(0, 1).unsqueeze(0))


def test_batch_mixing_a_fresh_prompt_and_a_prefix_hit(gen, new_pool, paged_atol):
    model = FakeModel(gen)
    shared = torch.randint(1, VOCAB, (BLOCK,), generator=gen).tolist()
    seed_prompt, hit_prompt = shared + [1, 2], shared + [3, 4, 5, 6, 7, 8]
    fresh_prompt = torch.randint(1, VOCAB, (5,), generator=gen).tolist()
    pool = new_pool()
    s0, _ = pool.allocate_sequence(seed_prompt)
    run(pool.prefill_view(s0), model, [seed_prompt], [0])
    s_hit, cached = pool.allocate_sequence(hit_prompt)
    s_fresh, none = pool.allocate_sequence(fresh_prompt)
    assert (cached, none) == (BLOCK, 0)
    rows = [hit_prompt[cached:], fresh_prompt]
    view = pool.batched_prefill_view([s_hit, s_fresh], [len(r) for r in rows])
    got = run(view, model, rows, [cached, 0])
    n_hit = len(rows[0])
    for layer, out in enumerate(got):
        assert out.shape[0] == n_hit + len(fresh_prompt)  # one row per token, no padding
        want_hit = full_prefill(model, hit_prompt)[layer][cached:]
        want_fresh = full_prefill(model, fresh_prompt)[layer]
        torch.testing.assert_close(out[:n_hit], want_hit, atol=paged_atol, rtol=0)
        torch.testing.assert_close(out[n_hit:], want_fresh, atol=paged_atol, rtol=0)
    assert (pool.get_num_computed_tokens(s_hit), pool.get_num_computed_tokens(s_fresh)) == (len(hit_prompt), 5)


@pytest.mark.parametrize("window", [None, 5])
def test_chunked_prefill_then_decode_equals_full_prefill(window, gen, new_pool, paged_atol):
    model = FakeModel(gen)
    prompt = torch.randint(1, VOCAB, (14,), generator=gen).tolist()
    want = full_prefill(model, prompt, window)
    pool = new_pool(prefix_caching=False)
    seq_id, _ = pool.allocate_sequence(prompt[:13])
    pieces = []
    for lo, hi in [(0, 5), (5, 6), (6, 13)]:
        pieces.append(run(pool.prefill_view(seq_id), model, [prompt[lo:hi]], [lo], window))
    pool.append_token(seq_id, prompt[13])
    pieces.append(run(pool.decode_view([seq_id]), model, [prompt[13:]], [13], window))
    for layer in range(LAYERS):
        got = torch.cat([p[layer] for p in pieces])
        torch.testing.assert_close(got, want[layer], atol=paged_atol, rtol=0)
    assert pool.get_num_computed_tokens(seq_id) == 14 and pool.audit() == []


def test_generic_view_runs_chunks_of_several_sequences(gen, new_pool, paged_atol):
    model = FakeModel(gen)
    a = torch.randint(1, VOCAB, (9,), generator=gen).tolist()
    b = torch.randint(1, VOCAB, (6,), generator=gen).tolist()
    pool = new_pool(prefix_caching=False)
    sa, _ = pool.allocate_sequence(a)
    sb, _ = pool.allocate_sequence(b)
    first = run(pool.view([sa, sb], [4, 2]), model, [a[:4], b[:2]], [0, 0])
    second = run(pool.view([sa, sb], [5, 4]), model, [a[4:], b[2:]], [4, 2])
    for layer in range(LAYERS):
        full_a, full_b = full_prefill(model, a)[layer], full_prefill(model, b)[layer]
        got_a = torch.cat([first[layer][:4], second[layer][:5]])
        got_b = torch.cat([first[layer][4:], second[layer][5:]])
        torch.testing.assert_close(got_a, full_a, atol=paged_atol, rtol=0)
        torch.testing.assert_close(got_b, full_b, atol=paged_atol, rtol=0)


@pytest.mark.parametrize("window", [None, 3])
def test_one_step_mixes_decodes_and_chunks_in_any_order(window, gen, new_pool, paged_atol):
    """One engine step (``step_view``, room reserved beforehand) where a decode
    sits between two prefill chunks, so each part's rows are picked out of the
    flat batch, and a prefix hit starts mid-prompt."""
    model = FakeModel(gen)
    a = torch.randint(1, VOCAB, (9,), generator=gen).tolist()
    b = torch.randint(1, VOCAB, (7,), generator=gen).tolist()
    c = a[:BLOCK] + torch.randint(1, VOCAB, (3,), generator=gen).tolist()
    pool = new_pool()
    sa, _ = pool.allocate_sequence(a)
    sb, _ = pool.allocate_sequence(b[:6])
    first = pool.step_view([sa, sb], [0, 0], [5, 6])
    run(first, model, [a[:5], b[:6]], [0, 0], window)
    pool.append_token(sb, b[6])
    sc, cached = pool.allocate_sequence(c)  # a's first block is computed: a hit
    assert cached == BLOCK
    view = pool.step_view([sa, sb, sc], [5, 6, cached], [4, 1, len(c) - cached])
    assert view.meta.decode.rows is not None  # the decode is not first: rows are picked
    got = run(view, model, [a[5:], b[6:], c[cached:]], [5, 6, cached], window)
    for layer, out in enumerate(got):
        want_a = full_prefill(model, a, window)[layer][5:]
        want_b = full_prefill(model, b, window)[layer][6:]
        want_c = full_prefill(model, c, window)[layer][cached:]
        torch.testing.assert_close(out[:4], want_a, atol=paged_atol, rtol=0)
        torch.testing.assert_close(out[4:5], want_b, atol=paged_atol, rtol=0)
        torch.testing.assert_close(out[5:], want_c, atol=paged_atol, rtol=0)
    assert [pool.get_num_computed_tokens(s) for s in (sa, sb, sc)] == [9, 7, len(c)]
    assert pool.audit() == []
