"""Triton paged prefill attention against paged_ref.ops on randomized page tables.

Each batch packs the situations a serving step produces: a chunk after a
prefix-cache hit spanning several query tiles, whole prompts of odd and
block-aligned length, a one-token chunk, and a sequence with no new tokens.
"""

from __future__ import annotations

import pytest
import torch

from paged_ref import ops as ref_ops
from paged_triton.ops import paged_prefill_attention

# heads, kv_heads, head_dim, block_size, sliding_window, softcap
CASES = [
    pytest.param(4, 4, 64, 16, None, None, id="mha-d64-bs16"),
    pytest.param(8, 2, 64, 8, 24, None, id="gqa4-d64-bs8-win"),
    pytest.param(4, 1, 80, 32, None, 2.0, id="mqa-d80-bs32-cap"),
    pytest.param(6, 2, 128, 16, 40, 5.0, id="gqa3-d128-bs16-win-cap"),
    pytest.param(32, 1, 32, 16, None, None, id="mqa32-groups-span-programs"),
]
ARGS = ("heads", "kv_heads", "head_dim", "block_size", "window", "softcap")


def contexts(block_size: int) -> list[tuple[int, int]]:
    """(total context, new queries) per sequence, longest first so others share its blocks."""
    return [
        (150, 90),
        (2 * block_size, 2 * block_size),
        (1, 1),
        (block_size + 3, 1),
        (40, 0),
        (block_size - 1, block_size - 1),
    ]


def make_inputs(seqs, heads, kv_heads, head_dim, block_size, dtype, gen, paged):
    lens = [n for n, _ in seqs]
    num_blocks = paged.blocks_needed(lens, block_size)
    k_cache, v_cache = paged.random_caches(num_blocks, kv_heads, block_size, head_dim, dtype, gen)
    tables = paged.random_block_tables(lens, block_size, num_blocks, gen).to(paged.device)
    q_lens = torch.tensor([q for _, q in seqs])
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = q_lens.cumsum(0)
    q = torch.randn(int(cu[-1]), heads, head_dim, generator=gen).to(paged.device, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=paged.device)
    return q, k_cache, v_cache, tables, cu.to(paged.device), seq_lens


@pytest.mark.parametrize(ARGS, CASES)
def test_prefill_matches_reference(
    heads, kv_heads, head_dim, block_size, window, softcap, dtype, gen, paged
):
    args = make_inputs(
        contexts(block_size), heads, kv_heads, head_dim, block_size, dtype, gen, paged
    )
    scale = head_dim**-0.5
    out = paged_prefill_attention(*args, scale, window, softcap)
    expected = ref_ops.paged_prefill_attention(*args, scale, window, softcap)
    paged.assert_close(out, expected, dtype)


def test_fully_masked_rows_are_zeros(gen, paged):
    seqs = [(30, 12), (5, 5)]
    args = make_inputs(seqs, 4, 2, 64, 16, torch.float32, gen, paged)
    out = paged_prefill_attention(*args, 0.125, 0)  # window 0: no query sees any key
    assert torch.isfinite(out).all() and (out == 0).all()
    visible = paged_prefill_attention(*args, 0.125, 1)  # window 1: each query sees only itself
    assert torch.isfinite(visible).all() and (visible != 0).any()
    paged.assert_close(visible, ref_ops.paged_prefill_attention(*args, 0.125, 1), torch.float32)


def test_batch_without_new_tokens_returns_empty(gen, paged):
    q, k_cache, v_cache, tables, cu, seq_lens = make_inputs(
        [(7, 0), (3, 0)], 2, 1, 32, 8, torch.float32, gen, paged
    )
    out = paged_prefill_attention(q, k_cache, v_cache, tables, cu, seq_lens, 0.2)
    assert out.shape == (0, 2, 32)


def test_step_memo_replays_one_plan_for_every_layer(gen, paged):
    """As for decode: later layers of a step reuse the first layer's plan
    with their own queries and caches."""
    memo: dict = {}
    first = None
    for _ in range(3):
        q, k_cache, v_cache, tables, cu, seq_lens = make_inputs(
            contexts(16), 4, 2, 64, 16, torch.float32, gen, paged
        )
        if first is not None:
            tables, cu, seq_lens = first
        first = (tables, cu, seq_lens)
        args = (q, k_cache, v_cache, tables, cu, seq_lens, 0.125)
        out = paged_prefill_attention(*args, memo=memo)
        paged.assert_close(out, ref_ops.paged_prefill_attention(*args), torch.float32)
    assert sum(key[0] == "paged_triton.prefill" for key in memo) == 1


def gpu_tiles(head_dim: int) -> list[int]:
    """One GPU (sm_80, 89, 90) per distinct prefill tile the table gives head_dim in bf16."""
    from paged_triton.tile_config import tile_config

    first: dict = {}
    for arch in (80, 89, 90):
        first.setdefault(tile_config("prefill", head_dim, torch.bfloat16, arch), arch)
    return list(first.values())


# heads, kv_heads, head_dim, window, softcap; the window is wide enough for unmasked key tiles.
ARCH_CASES = [
    pytest.param(arch, *layout, id=f"{name}-sm{arch}")
    for name, layout in (("gqa4-d64", (8, 2, 64, None, None)), ("gqa2-d128-win-cap", (4, 2, 128, 200, 5.0)))
    for arch in gpu_tiles(layout[2])
]


@pytest.mark.parametrize(("arch", "heads", "kv_heads", "head_dim", "window", "softcap"), ARCH_CASES)
def test_each_gpu_tile_matches_reference(
    arch, heads, kv_heads, head_dim, window, softcap, gen, paged
):
    """The tile the table picks for an sm_80/89/90 GPU (up to 128 query rows
    x 128 keys), run in the interpreter (float32: a key wrongly in or out of
    a row moves it by ~1e-3, far past the 2e-5 tolerance). The step puts
    whole unmasked key tiles before the diagonal (and, with the window,
    masked ones before them): a 120-token chunk after 200 cached tokens
    (several query tiles, none starting on a key-tile edge), a whole
    150-token prompt, a chunk of 1 and a sequence with none."""
    from paged_triton.prefill_attention import _INTERPRETED, plan_prefill
    from paged_triton.tile_config import tile_config

    if not _INTERPRETED and torch.cuda.get_device_capability() != divmod(arch, 10):
        pytest.skip("another GPU's tile may not fit this one")
    tile = tile_config("prefill", head_dim, torch.bfloat16, arch)
    args = make_inputs(
        [(320, 120), (150, 150), (70, 1), (40, 0)], heads, kv_heads, head_dim, 16,
        torch.float32, gen, paged,
    )  # fmt: skip
    scale = head_dim**-0.5
    out = torch.zeros_like(args[0])
    plan_prefill(*args, scale, window, softcap, out, arch, _INTERPRETED, tile=tile).run()
    expected = ref_ops.paged_prefill_attention(*args, scale, window, softcap)
    paged.assert_close(out, expected, torch.float32)
