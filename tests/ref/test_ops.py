"""Reference attention ops against torch SDPA and by-hand oracles."""

from __future__ import annotations

import pytest
import torch

from paged_ref import ops

HEAD_DIM = 16
BLOCK = 4
GQA_SHAPES = [(4, 4), (8, 2), (4, 1)]  # MHA, GQA 4:1, MQA


def _random_seqs(lens, kv_heads, gen):
    ks = [torch.randn(kv_heads, n, HEAD_DIM, generator=gen) for n in lens]
    vs = [torch.randn(kv_heads, n, HEAD_DIM, generator=gen) for n in lens]
    return ks, vs


def test_write_kv_places_tokens_and_skips_padding(gen):
    k_cache = torch.randn(6, BLOCK, 2, HEAD_DIM, generator=gen)
    v_cache = torch.randn(6, BLOCK, 2, HEAD_DIM, generator=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    k = torch.randn(4, 2, HEAD_DIM, generator=gen)
    v = torch.randn(4, 2, HEAD_DIM, generator=gen)
    seq_ids = torch.tensor([5 * BLOCK + 3, -1, 0, 2 * BLOCK + 1])
    ops.write_kv(k_cache, v_cache, k, v, seq_ids)
    written = {(5, 3): 0, (0, 0): 2, (2, 1): 3}
    for (blk, off), i in written.items():
        assert torch.equal(k_cache[blk, off], k[i])
        assert torch.equal(v_cache[blk, off], v[i])
    untouched = torch.ones(6, BLOCK, dtype=torch.bool)
    for blk, off in written:
        untouched[blk, off] = False
    assert torch.equal(k_cache[untouched], k_before[untouched])
    assert torch.equal(v_cache[untouched], v_before[untouched])


@pytest.mark.parametrize(("heads", "kv_heads"), GQA_SHAPES)
@pytest.mark.parametrize("window", [None, 3])
def test_decode_matches_sdpa(heads, kv_heads, window, gen, helpers):
    lens = [1, BLOCK, BLOCK + 1, 3 * BLOCK - 1, 2 * BLOCK]
    ks, vs = _random_seqs(lens, kv_heads, gen)
    k_cache, tables = helpers.scatter_to_pages(ks, 24, BLOCK, gen)
    v_cache = helpers.place_like(vs, tables, k_cache)
    q = torch.randn(len(lens), heads, HEAD_DIM, generator=gen)
    scale = 0.3
    out = ops.paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), scale, window
    )
    assert out.shape == q.shape
    for b, n in enumerate(lens):
        ref = helpers.sdpa_oracle(q[b].unsqueeze(1), ks[b], vs[b], n - 1, scale, window)
        torch.testing.assert_close(out[b], ref[:, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads"), GQA_SHAPES)
@pytest.mark.parametrize("window", [None, 5])
def test_prefill_with_cached_context_matches_sdpa(heads, kv_heads, window, gen, helpers):
    # (context including new tokens, new tokens): fresh prompt, chunk after a
    # cached prefix, a single token, and a sequence with no query this pass.
    shapes = [(7, 7), (13, 5), (BLOCK * 2, 1), (6, 0), (9, 9)]
    lens = [n for n, _ in shapes]
    ks, vs = _random_seqs(lens, kv_heads, gen)
    k_cache, tables = helpers.scatter_to_pages(ks, 24, BLOCK, gen)
    v_cache = helpers.place_like(vs, tables, k_cache)
    q_lens = [m for _, m in shapes]
    qs = [torch.randn(heads, m, HEAD_DIM, generator=gen) for m in q_lens]
    q_packed = torch.cat([q.transpose(0, 1) for q in qs])
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    out = ops.paged_prefill_attention(
        q_packed, k_cache, v_cache, tables, cu, torch.tensor(lens, dtype=torch.int32), scale, window
    )
    assert out.shape == q_packed.shape
    for b, (n, m) in enumerate(shapes):
        ref = helpers.sdpa_oracle(qs[b], ks[b], vs[b], n - m, scale, window)
        torch.testing.assert_close(
            out[cu[b] : cu[b + 1]].transpose(0, 1), ref, atol=1e-5, rtol=1e-5
        )


def test_softcap_matches_formula(gen, helpers):
    heads, kv_heads, n = 4, 2, 9
    ks, vs = _random_seqs([n], kv_heads, gen)
    k_cache, tables = helpers.scatter_to_pages(ks, 8, BLOCK, gen)
    v_cache = helpers.place_like(vs, tables, k_cache)
    q = torch.randn(n, heads, HEAD_DIM, generator=gen) * 4  # big scores so the cap bites
    cu = torch.tensor([0, n], dtype=torch.int32)
    lens = torch.tensor([n], dtype=torch.int32)
    out = ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 1.0, softcap=2.0)
    ref = helpers.naive_softcap_oracle(q.transpose(0, 1), ks[0], vs[0], 0, 1.0, 2.0)
    torch.testing.assert_close(out.transpose(0, 1), ref, atol=1e-5, rtol=1e-5)
    uncapped = ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 1.0)
    assert not torch.allclose(out, uncapped, atol=1e-3)
    dec = ops.paged_decode_attention(q[-1:], k_cache, v_cache, tables, lens, 1.0, softcap=2.0)
    torch.testing.assert_close(dec[0], ref[:, -1], atol=1e-5, rtol=1e-5)


def test_empty_context_gives_zeros_not_nan(gen):
    k_cache = torch.full((4, BLOCK, 1, HEAD_DIM), float("nan"))
    v_cache = torch.full((4, BLOCK, 1, HEAD_DIM), float("nan"))
    k_cache[0] = torch.randn(BLOCK, 1, HEAD_DIM, generator=gen)
    v_cache[0] = torch.randn(BLOCK, 1, HEAD_DIM, generator=gen)
    q = torch.randn(2, 2, HEAD_DIM, generator=gen)
    tables = torch.zeros(2, 1, dtype=torch.int32)
    out = ops.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([0, 3]), 1.0)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isfinite(out).all()


def test_output_keeps_query_dtype(gen):
    k_cache = torch.randn(4, BLOCK, 2, HEAD_DIM, generator=gen).half()
    v_cache = torch.randn(4, BLOCK, 2, HEAD_DIM, generator=gen).half()
    q = torch.randn(3, 4, HEAD_DIM, generator=gen).half()
    tables = torch.tensor([[1, 2]], dtype=torch.int32)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    out = ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, torch.tensor([6]), 0.25)
    assert out.dtype == torch.float16
    ref = ops.paged_prefill_attention(
        q.float(), k_cache.float(), v_cache.float(), tables, cu, torch.tensor([6]), 0.25
    )
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


def test_decode_equals_prefill_of_last_token(gen, helpers):
    lens = [5, 11]
    ks, vs = _random_seqs(lens, 2, gen)
    k_cache, tables = helpers.scatter_to_pages(ks, 12, BLOCK, gen)
    v_cache = helpers.place_like(vs, tables, k_cache)
    q = torch.randn(2, 4, HEAD_DIM, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    dec = ops.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.5, 4)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    pre = ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, seq_lens, 0.5, 4)
    torch.testing.assert_close(dec, pre, atol=1e-6, rtol=1e-6)


def test_copy_blocks_copies_every_layer(gen):
    k = torch.randn(3, 6, BLOCK, 2, HEAD_DIM, generator=gen)
    v = torch.randn(3, 6, BLOCK, 2, HEAD_DIM, generator=gen)
    k0, v0 = k.clone(), v.clone()
    ops.copy_blocks(k, v, torch.tensor([[1, 4], [2, 5]], dtype=torch.int64))
    for src, dst in [(1, 4), (2, 5)]:
        assert torch.equal(k[:, dst], k0[:, src])
        assert torch.equal(v[:, dst], v0[:, src])
    for blk in [0, 1, 2, 3]:
        assert torch.equal(k[:, blk], k0[:, blk])
    ops.copy_blocks(k, v, torch.empty(0, 2, dtype=torch.int64))  # no-op
