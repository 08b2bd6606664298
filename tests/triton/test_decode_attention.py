"""Triton paged decode attention against paged_ref.ops on randomized page tables.

A covering set of layouts rather than the full cartesian product (the
interpreter is slow): every head layout, head_dim, block size, window and
softcap setting appears, each case runs per dtype, once with the automatic
split choice and once forced through the flash-decoding split + merge path
(a policy that cuts every context of 128+ tokens into 64-token pieces, at
most 4). Every batch mixes the lengths the kernel's masks care about.
"""

from __future__ import annotations

import pytest
import torch

from paged_ref import ops as ref_ops
from paged_triton.decode_splits import SplitPolicy

SPLIT = SplitPolicy(min_chunk=64, target_programs=1 << 20, max_splits=4)

# heads, kv_heads, head_dim, block_size, sliding_window, softcap
CASES = [
    pytest.param(4, 4, 64, 16, None, None, id="mha-d64-bs16"),
    pytest.param(8, 2, 64, 8, None, None, id="gqa4-d64-bs8"),
    pytest.param(4, 1, 64, 32, None, None, id="mqa-d64-bs32"),
    pytest.param(8, 2, 128, 16, None, 2.0, id="gqa4-d128-bs16-cap"),
    pytest.param(4, 4, 80, 8, 40, None, id="mha-d80-bs8-win"),
    pytest.param(8, 2, 80, 32, 40, 2.0, id="gqa4-d80-bs32-win-cap"),
    pytest.param(6, 2, 128, 16, 100, None, id="gqa3-d128-bs16-win"),
    pytest.param(4, 1, 128, 8, 17, 5.0, id="mqa-d128-bs8-win-cap"),
    pytest.param(96, 1, 32, 16, None, None, id="mqa96-groups-span-programs"),
]
ARGS = ("heads", "kv_heads", "head_dim", "block_size", "window", "softcap")


def lengths(block_size: int) -> list[int]:
    """Longest first so sequences 1 and 3 share its leading blocks: a few
    hundred (4 pieces when split), exact multiples, one short of a block, a
    single token, and 130 (2 pieces of 64 and 66)."""
    return [300, 3 * block_size, 1, block_size, block_size - 1, 130]


def make_inputs(lens, heads, kv_heads, head_dim, block_size, dtype, gen, paged):
    num_blocks = paged.blocks_needed(lens, block_size)
    k_cache, v_cache = paged.random_caches(num_blocks, kv_heads, block_size, head_dim, dtype, gen)
    tables = paged.random_block_tables(lens, block_size, num_blocks, gen).to(paged.device)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(paged.device, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=paged.device)
    return q, k_cache, v_cache, tables, seq_lens


@pytest.mark.parametrize("policy", [None, SPLIT], ids=["auto-split", "split"])
@pytest.mark.parametrize(ARGS, CASES)
def test_decode_matches_reference(
    heads, kv_heads, head_dim, block_size, window, softcap, policy, dtype, gen, paged
):
    q, k_cache, v_cache, tables, seq_lens = make_inputs(
        lengths(block_size), heads, kv_heads, head_dim, block_size, dtype, gen, paged
    )
    scale = head_dim**-0.5
    out = paged.decode_attention(
        q, k_cache, v_cache, tables, seq_lens, scale, window, softcap, policy=policy
    )
    expected = ref_ops.paged_decode_attention(
        q, k_cache, v_cache, tables, seq_lens, scale, window, softcap
    )
    paged.assert_close(out, expected, dtype)


@pytest.mark.parametrize("policy", [None, SPLIT], ids=["auto-split", "split"])
def test_empty_and_fully_masked_rows_are_zeros(policy, gen, paged):
    lens = [0, 200, 0, 33]
    q, k_cache, v_cache, tables, seq_lens = make_inputs(
        lens, 4, 2, 64, 16, torch.float32, gen, paged
    )
    out = paged.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125, policy=policy)
    assert torch.isfinite(out).all()
    assert (out[[0, 2]] == 0).all() and (out[[1, 3]] != 0).any()
    # A window of 0 hides every key, even the query's own position.
    hidden = paged.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125, 0, policy=policy)
    assert (hidden == 0).all()
    expected = ref_ops.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125, 0)
    paged.assert_close(hidden, expected, torch.float32)


def test_stale_data_past_the_length_never_leaks(gen, paged):
    """Slots past a sequence's length and blocks it does not own hold NaN
    (stale or never written): the kernel must not even multiply by them."""
    lens, block_size = [37, 5, 200], 16
    q, k_cache, v_cache, tables, seq_lens = make_inputs(
        lens, 4, 2, 64, block_size, torch.float32, gen, paged
    )
    clean_k, clean_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    poisoned_k, poisoned_v = (
        torch.full_like(k_cache, float("nan")),
        torch.full_like(v_cache, float("nan")),
    )
    for b, n in enumerate(lens):
        for p in range(n):
            block, off = int(tables[b, p // block_size]), p % block_size
            for src, dsts in ((k_cache, (clean_k, poisoned_k)), (v_cache, (clean_v, poisoned_v))):
                for dst in dsts:
                    dst[block, off] = src[block, off]
    out = paged.decode_attention(q, poisoned_k, poisoned_v, tables, seq_lens, 0.125, policy=SPLIT)
    expected = ref_ops.paged_decode_attention(q, clean_k, clean_v, tables, seq_lens, 0.125)
    paged.assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("policy", [None, SPLIT], ids=["auto-split", "split"])
def test_step_memo_replays_one_plan_for_every_layer(policy, gen, paged):
    """With the step's memo, the first layer's plan is replayed by the next
    layers (other caches and queries, same shapes): each still reads its own
    tensors, and a layer with another window gets its own plan."""
    lens, block_size = lengths(16), 16
    memo: dict = {}
    step = None
    for window in (None, None, 40, None):
        q, k_cache, v_cache, tables, seq_lens = make_inputs(
            lens, 8, 2, 64, block_size, torch.float32, gen, paged
        )
        if step is not None:  # later layers: the same step's block tables and lengths
            tables, seq_lens = step
        step = (tables, seq_lens)
        out = paged.decode_attention(
            q, k_cache, v_cache, tables, seq_lens, 0.125, window, memo=memo, policy=policy
        )
        expected = ref_ops.paged_decode_attention(
            q, k_cache, v_cache, tables, seq_lens, 0.125, window
        )
        paged.assert_close(out, expected, torch.float32)
    assert sum(key[0] == "paged_triton.decode" for key in memo) == 2
