"""The C BGMV kernel (``paged_ref.cpu.lora_bgmv``) against the per-row
definition of a LoRA delta and against the torch path it replaces (the
decode rows masked over every slot), on random slot assignments: base rows
(-1) between adapter rows, one slot repeated past a chunk's ``GROUP`` rows,
widths and ranks that leave vector tails, one to three stacked projections,
every activation dtype, one thread and two."""

from __future__ import annotations

import pytest
import torch

from paged_ref import lora_ops
from paged_ref.cpu import lora_bgmv

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (6e-2, 2e-2), torch.float16: (1e-2, 5e-3)}


@pytest.fixture(autouse=True)
def _own_build_dir(tmp_path_factory, monkeypatch):
    """Each test session builds the kernel itself (a stale cached build would hide a source change)."""
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "paged-cache"))


def random_case(gen, slots, rank, in_features, sizes, dtype, rows):
    """A slot table (each slot of its own rank, zero-padded), a decode step's
    slots: -1 rows, and slot 0 for more rows than one chunk holds, and x/out."""
    s = len(sizes)
    a = torch.zeros(slots, s * rank, in_features)
    b = torch.zeros(sum(sizes), slots, rank)
    for slot in range(slots):
        r = int(torch.randint(1, rank + 1, (1,), generator=gen))
        for i in range(s):
            a[slot, i * rank : i * rank + r] = torch.randn(r, in_features, generator=gen) * 0.3
        b[:, slot, :r] = torch.randn(sum(sizes), r, generator=gen) * 0.3
    chosen = torch.randint(-1, slots, (rows,), generator=gen).tolist()
    for t in range(0, rows, 3):  # slot 0 on a third of the rows, scattered: chunks of GROUP and a short one
        chosen[t] = 0
    chosen[1] = -1
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    out = torch.randn(rows, sum(sizes), generator=gen).to(dtype)
    return a.to(dtype), b.to(dtype), chosen, x, out


def per_row(x, out, a, b, sizes, chosen):
    """The definition in float32, one row at a time: ``out[t] += B_i[s] @ (A_i[s] @ x[t])``."""
    want = out.float().clone()
    rank = a.shape[1] // len(sizes)
    for t, slot in enumerate(chosen):
        if slot < 0:
            continue
        start = 0
        for i, size in enumerate(sizes):
            h = a[slot, i * rank : (i + 1) * rank].float() @ x[t].float()
            want[t, start : start + size] += b[start : start + size, slot].float() @ h
            start += size
    return want


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("dtype", "rank", "in_features", "sizes"),
    [
        (torch.float32, 16, 256, (256, 64, 64)),  # the embedded model's q/k/v
        (torch.bfloat16, 16, 80, (72, 72)),  # gate/up; in not a multiple of 16, outs not of 32
        (torch.float16, 8, 200, (48,)),
        (torch.float32, 6, 33, (40, 24, 24)),  # a rank that leaves a DOTS tail
        (torch.bfloat16, 16, 768, (256,)),  # down
    ],
)
def test_kernel_equals_the_definition_and_the_masked_path(dtype, rank, in_features, sizes, threads, monkeypatch):
    if lora_bgmv._kernel(dtype) is None:
        pytest.skip("no C compiler: the masked torch path runs (tested below)")
    gen = torch.Generator().manual_seed(rank * 1000 + in_features)
    a, b, chosen, x, out = random_case(gen, 5, rank, in_features, sizes, dtype, rows=23)
    mapping = lora_ops.LoRAMapping.build([1] * len(chosen), chosen)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = out.clone()
        lora_ops.add_lora(x, got, a, b, sizes, mapping)
    finally:
        torch.set_num_threads(old)
    assert "bgmv" in mapping.memo  # the C path ran
    want = per_row(x, out, a, b, sizes, chosen)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
    base = torch.tensor(chosen) < 0
    assert torch.equal(got[base], out[base])  # base rows untouched
    assert (got.float() - out.float())[~base].abs().max() > 0.1  # real deltas, not zeros on both sides
    kernel = lora_bgmv._kernel
    if dtype == torch.bfloat16 and kernel(dtype, ("-mno-avx512bf16",)) is not None:
        # the pair products without vdpbf16ps, as a CPU without AVX512-BF16 runs them
        monkeypatch.setattr(lora_bgmv, "_kernel", lambda dtype: kernel(dtype, ("-mno-avx512bf16",)))
        monkeypatch.setattr(lora_ops, "_DERIVED", {})  # the tables prepared for the kernel above
        plain = out.clone()
        lora_ops.add_lora(x, plain, a, b, sizes, lora_ops.LoRAMapping.build([1] * len(chosen), chosen))
        torch.testing.assert_close(plain.float(), want, atol=atol, rtol=rtol)
    monkeypatch.setattr(lora_bgmv, "_kernel", lambda dtype: None)  # no compiler: the masked torch path
    monkeypatch.setattr(lora_ops, "_DERIVED", {})
    masked = out.clone()
    lora_ops.add_lora(x, masked, a, b, sizes, lora_ops.LoRAMapping.build([1] * len(chosen), chosen))
    torch.testing.assert_close(got.float(), masked.float(), atol=atol, rtol=rtol)


def test_plan_groups_rows_by_slot_in_chunks():
    p = lora_bgmv.plan(torch.tensor([3, -1, 3, 0, 3, 3, 3, 3, 1, -1], dtype=torch.int32))
    assert p.rows.tolist() == [3, 8, 0, 2, 4, 5, 6, 7]  # sorted by slot, base rows out, stable
    assert p.row_slots.tolist() == [0, 1, 3, 3, 3, 3, 3, 3]
    assert p.chunks.tolist() == [0, 1, 2, 2 + lora_bgmv.GROUP, 8]  # slot 3's six rows: a full chunk and two
    assert lora_bgmv.plan(torch.full((4,), -1, dtype=torch.int32)).num_chunks == 0


def test_a_step_without_adapter_rows_adds_nothing():
    a = torch.randn(2, 16, 32)
    b = torch.randn(8, 2, 16)
    x, out = torch.randn(3, 32), torch.randn(3, 8)
    got = out.clone()
    lora_ops.add_lora(x, got, a, b, (8,), lora_ops.LoRAMapping.build([1, 1, 1], [-1, -1, -1]))
    assert torch.equal(got, out)
