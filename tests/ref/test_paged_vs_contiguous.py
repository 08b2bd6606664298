"""The same K/V stream through the contiguous and the paged pool gives the
same attention outputs: packed prefill then decode steps, with page tables
shuffled by earlier frees, for GQA 4:1 and MQA, sliding window on and off,
and with stale NaN in the reused blocks."""

from __future__ import annotations

import pytest
import torch

from paged_ref import ContiguousKVPool, PagedKVPool

LAYERS, DIM, BLOCK = 2, 16, 4


def shuffled_paged_pool(
    kv_heads, ops, gen, num_blocks=40, dtype=torch.float32, device="cpu", layers=LAYERS
):
    """A paged pool whose free list was scrambled by freeing blocks in random order."""
    pool = PagedKVPool.from_model_config(
        layers, kv_heads, DIM, num_blocks, BLOCK, dtype, device,
        enable_prefix_caching=False, ops=ops,
    )  # fmt: skip
    dummies = [pool.allocate_seq(BLOCK) for _ in range(num_blocks)]
    for i in torch.randperm(num_blocks, generator=gen).tolist():
        pool.free_seq(dummies[i])
    return pool


def run_stream(pool, steps, prompt_lens, window, softcap):
    """Packed prefill of every prompt (``steps[0]``), then one decode step per
    further entry of ``steps``, room reserved by ``append_token`` and one
    decode view reused from step to step; returns every attention output in
    order."""
    seq_ids = [pool.allocate_sequence([7] * n)[0] for n in prompt_lens]
    outs = []
    decode = None
    for i, layers in enumerate(steps):
        if i == 0:
            view = pool.batched_prefill_view(seq_ids, prompt_lens)
        else:
            for s in seq_ids:
                pool.append_token(s, 7)
            view = decode = decode or pool.decode_view(seq_ids)
        for layer, (q, k, v) in enumerate(layers):
            outs.append(
                view.attend(layer, q, k, v, scale=DIM**-0.5, sliding_window=window, softcap=softcap)
            )
        view.advance(1)
    assert [pool.get_num_computed_tokens(s) for s in seq_ids] == [n + len(steps) - 1 for n in prompt_lens]
    assert pool.audit() == []
    return outs


def flat_steps(heads, kv_heads, prompt_lens, decodes, layers, gen, score_scale=1.0):
    """Random flat q/k/v per layer: one packed prefill of ``prompt_lens``, then
    ``decodes`` steps of one token per sequence. ``score_scale`` multiplies q
    and k (bigger scores), leaving v, and so the outputs' size, as drawn."""

    def qkv(n):
        q = torch.randn(n, heads, DIM, generator=gen) * score_scale
        k = torch.randn(n, kv_heads, DIM, generator=gen) * score_scale
        return q, k, torch.randn(n, kv_heads, DIM, generator=gen)

    sizes = [sum(prompt_lens)] + [len(prompt_lens)] * decodes
    return [[qkv(n) for _ in range(layers)] for n in sizes]


@pytest.mark.backend
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 1)], ids=["gqa4", "mqa"])
@pytest.mark.parametrize("window", [None, 3], ids=["full", "window3"])
def test_paged_equals_contiguous(heads, kv_heads, window, paged_ops, paged_atol, gen):
    prompt_lens = [5, 11, 8]
    batch = len(prompt_lens)
    steps = flat_steps(heads, kv_heads, prompt_lens, 6, LAYERS, gen)
    contiguous = ContiguousKVPool.from_model_config(
        LAYERS, kv_heads, DIM, 32, batch, dtype=torch.float32
    )
    paged = shuffled_paged_pool(kv_heads, paged_ops, gen)
    expected = run_stream(contiguous, steps, prompt_lens, window, None)
    got = run_stream(paged, steps, prompt_lens, window, None)
    tables = [paged.block_table(s) for s in paged.block_manager.seq_ids()]
    assert any(t != sorted(t) or t[-1] - t[0] != len(t) - 1 for t in tables), "tables not shuffled"
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=paged_atol, rtol=0)
        assert torch.isfinite(g).all()


@pytest.mark.backend
def test_paged_equals_contiguous_with_softcap(paged_ops, paged_atol, gen):
    heads, kv_heads, lens = 4, 2, [6, 3]
    steps = flat_steps(heads, kv_heads, lens, 2, 1, gen, score_scale=3.0)  # the cap bites
    contiguous = ContiguousKVPool.from_model_config(1, kv_heads, DIM, 16, 2, dtype=torch.float32)
    paged = shuffled_paged_pool(kv_heads, paged_ops, gen)
    for e, g in zip(
        run_stream(contiguous, steps, lens, None, 5.0),
        run_stream(paged, steps, lens, None, 5.0),
        strict=True,
    ):
        torch.testing.assert_close(g, e, atol=paged_atol, rtol=0)


@pytest.mark.backend
def test_stale_nan_in_reused_blocks_does_not_leak(paged_ops, paged_atol, gen):
    """Blocks and seq_ids freed by earlier sequences may hold anything, even NaN:
    the tails of last blocks and the blocks a sliding window has left (window
    3 over blocks of 4, so windows cross block boundaries) must not reach the
    outputs of either pool."""
    heads, kv_heads, lens = 4, 2, [5, 10, 3]
    steps = flat_steps(heads, kv_heads, lens, 4, LAYERS, gen)

    def contiguous_pool():
        return ContiguousKVPool.from_model_config(LAYERS, kv_heads, DIM, 16, 3, dtype=torch.float32)

    expected = run_stream(contiguous_pool(), steps, lens, 3, None)  # zeroed: nothing stale
    stale_contiguous, stale_paged = contiguous_pool(), shuffled_paged_pool(kv_heads, paged_ops, gen)
    for pool in (stale_contiguous, stale_paged):
        pool.k_cache.fill_(float("nan"))
        pool.v_cache.fill_(float("nan"))
    for pool, atol in ((stale_contiguous, 1e-6), (stale_paged, paged_atol)):
        for e, g in zip(expected, run_stream(pool, steps, lens, 3, None), strict=True):
            assert torch.isfinite(g).all()
            torch.testing.assert_close(g, e, atol=atol, rtol=0)


@pytest.mark.cuda
@pytest.mark.backend
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_equals_contiguous_on_cuda(dtype, paged_ops, gen):
    heads, kv_heads, lens = 8, 2, [5, 11, 8]
    steps = [
        [tuple(t.to("cuda", dtype) for t in layer) for layer in step]
        for step in flat_steps(heads, kv_heads, lens, 3, LAYERS, gen)
    ]
    contiguous = ContiguousKVPool.from_model_config(
        LAYERS, kv_heads, DIM, 32, 3, dtype=dtype, device="cuda"
    )
    paged = shuffled_paged_pool(kv_heads, paged_ops, gen, dtype=dtype, device="cuda")
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    for e, g in zip(
        run_stream(contiguous, steps, lens, 3, None),
        run_stream(paged, steps, lens, 3, None),
        strict=True,
    ):
        assert g.device.type == "cuda" and g.dtype == dtype
        torch.testing.assert_close(g.float(), e.float(), atol=atol, rtol=0)
