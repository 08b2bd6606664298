"""The reference ops cut a batch into cache-sized chunks of sequences; the
results must not depend on where the cuts fall."""

from __future__ import annotations

import pytest
import torch

from paged_ref import gather as gather_mod
from paged_ref import ops

BLOCK = 4


@pytest.mark.parametrize("window", [None, 3])
def test_chunked_attention_equals_one_chunk(monkeypatch, gen, helpers, window) -> None:
    lens = [1, 5, 13, 8, 20, 2]
    ks = [torch.randn(2, n, 16, generator=gen) for n in lens]
    vs = [torch.randn(2, n, 16, generator=gen) for n in lens]
    k_cache, tables = helpers.scatter_to_pages(ks, 40, BLOCK, gen)
    v_cache = helpers.place_like(vs, tables, k_cache)
    k_cache[~torch.isfinite(k_cache)] = 0
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q_dec = torch.randn(len(lens), 4, 16, generator=gen)
    q_lens = [min(n, 3) for n in lens]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q_pre = torch.randn(int(cu[-1]), 4, 16, generator=gen)

    def run():
        return (
            ops.paged_decode_attention(q_dec, k_cache, v_cache, tables, seq_lens, 0.3, window),
            ops.paged_prefill_attention(q_pre, k_cache, v_cache, tables, cu, seq_lens, 0.3, window),
        )

    whole = run()
    chunks = gather_mod.plan_chunks(tables, seq_lens.long(), torch.zeros(6, dtype=torch.long), k_cache)
    assert len(chunks) == 1
    monkeypatch.setattr(gather_mod, "CHUNK_BYTES", 1)  # every sequence its own chunk
    chunks = gather_mod.plan_chunks(tables, seq_lens.long(), torch.zeros(6, dtype=torch.long), k_cache)
    assert [c.size for c in chunks] == [1] * 6
    for got, want in zip(run(), whole, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kv_cache_dtype", [torch.float32, torch.int8])
def test_a_step_memo_shared_by_layers_and_parts_changes_nothing(
    monkeypatch, gen, helpers, kv_cache_dtype
) -> None:
    """Every chunk of every layer, decode and prefill, gathers into one scratch
    buffer kept in the step's memo: results equal those without a memo."""
    from paged_ref.kv_quant import new_scales, quantize

    monkeypatch.setattr(gather_mod, "CHUNK_BYTES", 3 * 24 * 2 * 2 * 16 * 4)  # ~3 sequences a chunk
    lens = [1, 5, 13, 8, 20, 2, 17]
    layers = []
    tables = None
    for _ in range(2):  # two layers: same page tables (the memo's plans), their own K/V
        ks = [torch.randn(2, n, 16, generator=gen) for n in lens]
        vs = [torch.randn(2, n, 16, generator=gen) for n in lens]
        if tables is None:
            k_cache, tables = helpers.scatter_to_pages(ks, 60, BLOCK, gen)
            like = k_cache
        else:
            k_cache = helpers.place_like(ks, tables, like)
        v_cache = helpers.place_like(vs, tables, like)
        k_cache[~torch.isfinite(k_cache)] = 0
        v_cache[~torch.isfinite(v_cache)] = 0
        scales = {}
        if kv_cache_dtype == torch.int8:
            k_cache, k_s = quantize(k_cache, torch.int8)
            v_cache, v_s = quantize(v_cache, torch.int8)
            assert new_scales(k_cache) is not None
            scales = {"k_scales": k_s, "v_scales": v_s}
        layers.append((k_cache, v_cache, tables, scales))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q_dec = torch.randn(len(lens), 4, 16, generator=gen)
    q_lens = [min(n, 3) for n in lens]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q_pre = torch.randn(int(cu[-1]), 4, 16, generator=gen)

    def run(memo):
        out = []
        for k_cache, v_cache, tables, s in layers:
            out.append(ops.paged_decode_attention(
                q_dec, k_cache, v_cache, tables, seq_lens, 0.3, memo=memo, **s))
            out.append(ops.paged_prefill_attention(
                q_pre, k_cache, v_cache, tables, cu, seq_lens, 0.3, memo=memo, **s))
        return out  # fmt: skip

    memo: dict = {}
    shared = run(memo)
    assert ("scratch", torch.float32) in memo  # one float32 buffer for all layers and parts
    for got, want in zip(shared, run(None), strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
