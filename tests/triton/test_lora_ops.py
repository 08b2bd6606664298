"""The LoRA kernels (``paged_triton.lora_ops``) against the reference op
(``paged_ref.lora_ops``) on random adapter assignments: decode rows, prompt
runs of several adapters with base runs between them, padding rows, one to
three stacked projections of unequal widths, ranks below the table's, and a
single decode row whose shrink is split along ``in``."""

from __future__ import annotations

import pytest
import torch

from paged_ref import lora_ops as ref
from paged_triton import lora_ops as tri

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCES = {
    # float32: both sides in float32, different summation order
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    # float16 (bfloat16): the reference runs in float32 on the same rounded
    # inputs; the kernels round the shrink to float16 before the prompt
    # runs' expand, and the result: a few ulps of outputs of size ~4
    torch.float16: dict(atol=2e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=1e-1, rtol=5e-2),
}
DTYPES = [torch.float32, torch.float16]
if torch.cuda.is_available():  # the interpreter's bf16 dot is not the GPU's
    DTYPES.append(torch.bfloat16)


def random_table(slots, rank, in_features, slice_sizes, dtype, gen, ranks=None):
    """A slot table with each slot's adapter of rank ``ranks[s]`` (zero-padded to ``rank``)."""
    s = len(slice_sizes)
    a = torch.zeros(slots, s * rank, in_features)
    b = torch.zeros(sum(slice_sizes), slots, rank)
    for slot in range(slots):
        r = rank if ranks is None else ranks[slot]
        for i in range(s):
            a[slot, i * rank : i * rank + r] = torch.randn(r, in_features, generator=gen) * 0.3
        b[:, slot, :r] = torch.randn(sum(slice_sizes), r, generator=gen) * 0.3
    return a.to(dtype), b.to(dtype)


def random_step(gen, slots, decodes, prompts, pad=0, device=DEVICE):
    """Sequence lengths (``decodes`` one-token rows first) and random slots (-1 included)."""
    lens = [1] * decodes + [int(torch.randint(1, 70, (1,), generator=gen)) for _ in range(prompts)]
    chosen = torch.randint(-1, slots, (len(lens),), generator=gen).tolist()
    if prompts >= 2:  # two neighbouring runs of one adapter, merged into one
        chosen[-1] = chosen[-2] = 0
    mapping = ref.LoRAMapping.build(lens, chosen, device, rows=sum(lens) + pad)
    return lens, chosen, mapping


def both(x, out, a, b, sizes, mapping):
    """(the reference in float32 on the same inputs, the kernels' result)"""
    want, got = out.float(), out.clone()
    ref.add_lora(x.float(), want, a.float(), b.float(), sizes, mapping)
    tri.add_lora(x, got, a, b, sizes, mapping)
    return want, got


def test_mapping_groups_rows_like_the_kernels_read_them():
    m = ref.LoRAMapping.build([1, 1, 5, 3, 4, 2], [2, -1, 0, 0, -1, 1], rows=20)
    assert m.token_slots.tolist() == [2, -1] + [0] * 8 + [-1] * 4 + [1] * 2 + [-1] * 4
    assert m.decode_rows == 2
    assert m.segment_starts.tolist() == [2, 10, 14, 16]  # adapter 0's two chunks are one run
    assert m.segment_slots.tolist() == [0, -1, 1]
    assert m.max_segment_len == 8  # the base run does not count
    assert m.runs == ((2, 10, 0), (14, 16, 1))  # the adapter runs, on the host


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "sizes,decodes,prompts",
    [((48,), 5, 0), ((40, 24, 24), 3, 4), ((72, 72), 0, 3), ((96,), 7, 2)],
    ids=["o-decode", "qkv-mixed", "gate_up-prompts", "down-mixed"],
)
def test_kernels_equal_the_reference(dtype, sizes, decodes, prompts):
    gen = torch.Generator().manual_seed(len(sizes) * 100 + decodes * 10 + prompts)
    slots, rank, in_features = 4, 16, 80  # 80: not a multiple of the tiles
    a, b = random_table(slots, rank, in_features, sizes, dtype, gen, ranks=[16, 8, 3, 16])
    lens, _, mapping = random_step(gen, slots, decodes, prompts, pad=3)
    rows = mapping.token_slots.shape[0]
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    out = torch.randn(rows, sum(sizes), generator=gen).to(dtype)
    args = [t.to(DEVICE) for t in (x, out, a, b)]
    want, got = both(*args, sizes, mapping)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), want.cpu(), **TOLERANCES[dtype])
    base = (mapping.token_slots < 0).cpu()
    assert torch.equal(got.cpu()[base], out[base])  # base and padding rows untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_one_decode_row_splits_its_shrink(dtype):
    gen = torch.Generator().manual_seed(7)
    in_features = 1500  # three split-K pieces, the last one short
    assert tri.split_k(1, 3 * 8, in_features) == 3
    a, b = random_table(2, 8, in_features, (16, 8, 8), dtype, gen)
    mapping = ref.LoRAMapping.build([1], [1], DEVICE)
    x = torch.randn(1, in_features, generator=gen).to(dtype)
    out = torch.zeros(1, 32, dtype=dtype)
    want, got = both(*(t.to(DEVICE) for t in (x, out, a, b)), (16, 8, 8), mapping)
    torch.testing.assert_close(got.float().cpu(), want.cpu(), **TOLERANCES[dtype])
    assert want.abs().max() > 1  # a real delta, not zeros on both sides


@pytest.mark.parametrize("seed", range(4))
def test_random_assignments(seed):
    """Random tables, ranks and steps in float32: every row's own adapter."""
    gen = torch.Generator().manual_seed(1000 + seed)
    slots = int(torch.randint(1, 6, (1,), generator=gen))
    rank = [8, 16, 32][seed % 3]
    sizes = [(64,), (32, 16, 16), (48, 48)][seed % 3]
    in_features = int(torch.randint(16, 200, (1,), generator=gen))
    ranks = torch.randint(1, rank + 1, (slots,), generator=gen).tolist()
    a, b = random_table(slots, rank, in_features, sizes, torch.float32, gen, ranks)
    _, _, mapping = random_step(gen, slots, seed * 3, 1 + seed)
    rows = mapping.token_slots.shape[0]
    x = torch.randn(rows, in_features, generator=gen)
    out = torch.randn(rows, sum(sizes), generator=gen)
    want, got = both(*(t.to(DEVICE) for t in (x, out, a, b)), sizes, mapping)
    torch.testing.assert_close(got.cpu(), want.cpu(), **TOLERANCES[torch.float32])


def per_row(x, out, a, b, sizes, token_slots):
    """The definition, one row at a time: ``out[t] += B_i[s] @ (A_i[s] @ x[t])``."""
    out = out.clone()
    rank = a.shape[1] // len(sizes)
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        start = 0
        for i, size in enumerate(sizes):
            h = a[slot, i * rank : (i + 1) * rank] @ x[t]
            out[t, start : start + size] += b[start : start + size, slot] @ h
            start += size
    return out


@pytest.mark.parametrize("seed", range(3))
def test_reference_equals_the_per_row_definition(seed):
    """The reference's grouping (decode rows masked over every slot, a GEMM
    pair per prompt run) is only a grouping: each row gets its own slot's delta."""
    gen = torch.Generator().manual_seed(2000 + seed)
    sizes = [(40, 24, 24), (72, 72), (96,)][seed]
    a, b = random_table(3, 8, 50, sizes, torch.float32, gen, ranks=[8, 2, 5])
    _, _, mapping = random_step(gen, 3, 4, 3, pad=2, device="cpu")
    assert mapping.decode_rows == 4 and mapping.runs  # both groupings in use
    rows = mapping.token_slots.shape[0]
    x, out = torch.randn(rows, 50, generator=gen), torch.randn(rows, sum(sizes), generator=gen)
    want = per_row(x, out, a, b, sizes, mapping.token_slots)
    got = out.clone()
    ref.add_lora(x, got, a, b, sizes, mapping)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
