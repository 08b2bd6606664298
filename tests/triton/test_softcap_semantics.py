"""``softcap`` means the same in both backends: None and 0 turn it off, a
positive value caps every scaled score at +-softcap (``softcap * tanh(s /
softcap)``) before masking."""

from __future__ import annotations

import pytest
import torch

from paged_ref import ops as ref_ops
from paged_triton import ops as triton_ops

BACKENDS = [pytest.param(ref_ops, id="ref"), pytest.param(triton_ops, id="triton")]
LENS, Q_LENS, BLOCK_SIZE = [40, 9], [5, 9], 8


@pytest.fixture
def step(gen, paged):
    """One decode batch and one prefill batch over the same paged context,
    with scores large enough (scale 1, head_dim 32) for a cap to matter."""
    num_blocks = paged.blocks_needed(LENS, BLOCK_SIZE)
    k_cache, v_cache = paged.random_caches(num_blocks, 2, BLOCK_SIZE, 32, torch.float32, gen)
    tables = paged.random_block_tables(LENS, BLOCK_SIZE, num_blocks, gen).to(paged.device)
    seq_lens = torch.tensor(LENS, dtype=torch.int32, device=paged.device)
    cu = torch.tensor([0, Q_LENS[0], sum(Q_LENS)], dtype=torch.int32, device=paged.device)
    q_dec = torch.randn(len(LENS), 4, 32, generator=gen).to(paged.device)
    q_pre = torch.randn(sum(Q_LENS), 4, 32, generator=gen).to(paged.device)

    def run(ops, softcap):
        decode = ops.paged_decode_attention(
            q_dec, k_cache, v_cache, tables, seq_lens, 1.0, None, softcap
        )
        prefill = ops.paged_prefill_attention(
            q_pre, k_cache, v_cache, tables, cu, seq_lens, 1.0, None, softcap
        )
        return decode, prefill

    run.context_v = ref_ops.gather_context(v_cache, tables, seq_lens)  # [B, kv_heads, L, D]
    return run


@pytest.mark.parametrize("ops", BACKENDS)
@pytest.mark.parametrize("off", [0, 0.0], ids=["int-0", "float-0"])
def test_zero_means_no_cap(ops, off, step):
    for got, expected in zip(step(ops, off), step(ops, None), strict=True):
        assert torch.isfinite(got).all()
        assert torch.equal(got, expected)


@pytest.mark.parametrize("ops", BACKENDS)
def test_positive_cap_changes_the_result(ops, step):
    for capped, uncapped in zip(step(ops, 2.0), step(ops, None), strict=True):
        assert (capped - uncapped).abs().max() > 1e-2


def test_backends_agree_on_and_off(step, paged):
    for softcap in (None, 0, 0.0, 2.0, 50.0):
        for ours, ref in zip(step(triton_ops, softcap), step(ref_ops, softcap), strict=True):
            paged.assert_close(ours, ref, torch.float32)


@pytest.mark.parametrize("ops", BACKENDS)
def test_tiny_cap_makes_attention_uniform(ops, step):
    """A cap near 0 squashes every score to ~0, so each decode query
    averages V over exactly the keys it sees (the cap applies before
    masking; masked keys stay masked)."""
    decode, _ = step(ops, 1e-6)
    v = step.context_v
    for b, n in enumerate(LENS):
        for h in range(decode.shape[1]):
            expected = v[b, h // 2, :n].mean(0)  # 4 heads over 2 kv heads
            assert torch.allclose(decode[b, h], expected, atol=1e-5)
