"""LoRA deltas for a batch that mixes adapters: the per-step mapping and the
reference op.

A step's flat batch holds rows of several sequences, each served with its
own adapter (or none). The adapters of a projection sit in a fixed table of
``slots``; :class:`LoRAMapping` says which slot each row reads (``-1``: the
base model, no delta) and, for the kernels, the same rows grouped the way
Punica / S-LoRA group them: the leading one-token rows (decodes: BGMV, one
gathered matrix-vector product per row) and runs of consecutive rows of one
adapter (prompt chunks: SGMV, a GEMM per run).

:func:`add_lora` adds every row's delta to a projection's output::

    out[t] += B[slot(t)] @ (A[slot(t)] @ x[t])      (scaling folded into B)

for each stacked projection of a fused layer (q/k/v, gate/up): its own A
rows and its own B rows and output columns. ``paged_triton.lora_ops`` has
the same signature (``@op(LoRAArgs)``) and is tested against this one.

Layouts: ``lora_a [slots, S * R, in]`` (slot-major: a slot loads as one
block; projection ``i``'s rank-``R`` rows at ``i * R``), ``lora_b [out,
slots, R]`` (output-major, so all slots read as one ``[out, slots * R]``
matrix). ``R`` is ``max_lora_rank``: smaller adapters are zero-padded,
which adds exact zeros. The reference groups the work as the kernels do:
the decode rows' shrink against every slot in one GEMM, all but each row's
own masked out (on a CPU cheaper than a copy of A and B gathered per row),
then one GEMM pair per prompt run (masking every slot there would cost
``slots`` times the run's work). No host sync: the runs are known when the
mapping is built.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from paged_ref.cpu import lora_bgmv
from paged_ref.op_args import op

__all__ = ["LoRAArgs", "LoRAMapping", "add_lora"]


@dataclass(slots=True)
class LoRAMapping:
    """One step's rows -> adapter slots, built once on the host and shared
    by every projection of every layer.

    ``token_slots [rows]`` int32: each row's slot, -1 for the base model
    (and padding rows). Rows ``[0, decode_rows)`` are one-token sequences;
    after them, ``segment_starts [segments + 1]`` / ``segment_slots
    [segments]`` (int32) cut the rest into runs of consecutive rows of one
    slot (prompt chunks; neighbours of one adapter merged; base runs keep
    -1 and are skipped), the longest adapter run ``max_segment_len`` rows;
    ``runs`` lists the adapter runs again on the host. ``token_slots``
    alone defines the result; the rest is how the ops group the work."""

    token_slots: Tensor
    decode_rows: int
    segment_starts: Tensor
    segment_slots: Tensor
    max_segment_len: int
    runs: tuple[tuple[int, int, int], ...] = ()  # the adapter runs on the host: (start, end, slot)
    memo: dict[Any, Any] = field(default_factory=dict)  # what every projection of the step reuses

    @property
    def num_segments(self) -> int:
        return int(self.segment_slots.shape[0])

    @classmethod
    def build(
        cls,
        lens: Sequence[int],
        slots: Sequence[int],
        device: torch.device | str = "cpu",
        rows: int | None = None,
    ) -> LoRAMapping:
        """From the step's sequences in flat-batch order: ``lens[i]`` rows of
        sequence ``i``, served by ``slots[i]`` (-1: base). ``rows``: the
        batch's padded row count (padding rows get -1). One copy to
        ``device`` per tensor."""
        if len(lens) != len(slots):
            raise ValueError(f"{len(lens)} sequence lengths but {len(slots)} slots")
        total = int(sum(lens))
        rows = total if rows is None else rows
        if rows < total:
            raise ValueError(f"rows ({rows}) is less than the sequences' {total} tokens")
        token_slots = np.full(rows, -1, dtype=np.int32)
        token_slots[:total] = np.repeat(np.asarray(slots, dtype=np.int32), np.asarray(lens))
        decode_rows = 0  # each leading one-token sequence is one row
        while decode_rows < len(lens) and lens[decode_rows] == 1:
            decode_rows += 1
        starts: list[int] = [decode_rows]
        run_slots: list[int] = []
        for n, slot in zip(lens[decode_rows:], slots[decode_rows:], strict=True):
            if n == 0:
                continue
            if run_slots and run_slots[-1] == slot:
                starts[-1] += n  # the same adapter as the run before: one run
            else:
                run_slots.append(slot)
                starts.append(starts[-1] + n)
        longest = max(
            (starts[i + 1] - starts[i] for i, slot in enumerate(run_slots) if slot >= 0), default=0
        )
        seg_starts = np.asarray(starts, dtype=np.int32)
        seg_slots = np.asarray(run_slots, dtype=np.int32)

        def to(a: np.ndarray) -> Tensor:
            return torch.from_numpy(a).to(device)

        runs = tuple(
            (starts[i], starts[i + 1], slot) for i, slot in enumerate(run_slots) if slot >= 0
        )
        return cls(
            to(token_slots), decode_rows, to(seg_starts), to(seg_slots), longest, runs
        )


@dataclass(slots=True)
class LoRAArgs:
    """``add_lora``'s: a projection's input ``x [rows, in]`` and output
    ``out [rows, sum(slice_sizes)]`` (the delta is added in place; leading
    dimensions beyond one are flattened), its slot table ``lora_a [slots,
    S * R, in]`` and ``lora_b [out, slots, R]``, the output width of each of
    its ``S`` stacked projections, and the step's ``mapping``."""

    x: Tensor
    out: Tensor
    lora_a: Tensor
    lora_b: Tensor
    slice_sizes: tuple[int, ...]
    mapping: LoRAMapping


def check_lora_args(a: LoRAArgs) -> tuple[Tensor, Tensor, int]:
    """``x`` and ``out`` as ``[rows, features]`` and the padded rank ``R``,
    or an error naming the shape that does not fit."""
    in_features = a.lora_a.shape[-1]
    out_features = sum(a.slice_sizes)
    # (a 2-D x and out as they are: a reshape's dispatch, once per projection and layer, adds up)
    x = a.x if a.x.dim() == 2 else a.x.reshape(-1, in_features)
    out = a.out if a.out.dim() == 2 else a.out.view(-1, out_features)
    if x.shape[1] != in_features or out.shape[1] != out_features:
        raise ValueError(
            f"x has {x.shape[1]} features and out {out.shape[1]}, but the slot table maps "
            f"{in_features} to {out_features}"
        )
    slots, stacked, _ = a.lora_a.shape
    if stacked % len(a.slice_sizes):
        raise ValueError(
            f"lora_a holds {stacked} rows per slot, not a multiple of {len(a.slice_sizes)} projections"
        )
    rank = stacked // len(a.slice_sizes)
    if tuple(a.lora_b.shape) != (out_features, slots, rank):
        raise ValueError(
            f"lora_b has shape {tuple(a.lora_b.shape)}, expected {(out_features, slots, rank)} "
            f"for lora_a {tuple(a.lora_a.shape)} and slice sizes {a.slice_sizes}"
        )
    if x.shape[0] != out.shape[0] or a.mapping.token_slots.shape[0] != x.shape[0]:
        raise ValueError(
            f"x has {x.shape[0]} rows, out {out.shape[0]}, the mapping "
            f"{a.mapping.token_slots.shape[0]}; they must be the same step"
        )
    return x, out, rank


@op(LoRAArgs)
def add_lora(a: LoRAArgs) -> None:
    """Add each row's LoRA delta to ``out`` in place: row ``t`` of stacked
    projection ``i`` gets ``(x[t] @ A_i[s].T) @ B_i[s].T`` with ``s`` the
    row's slot (nothing for -1). The work is grouped as the kernels group
    it: the decode rows together (every slot's shrink, all but each row's
    own masked out), then one GEMM pair per prompt run."""
    x, out, rank = check_lora_args(a)
    m = a.mapping
    if m.decode_rows == x.shape[0]:  # a decode-only step: no views to make
        _add_rows(x, out, a, rank)
    elif m.decode_rows:
        _add_rows(x[: m.decode_rows], out[: m.decode_rows], a, rank)
    for start, end, slot in m.runs:
        _add_run(x[start:end], out[start:end], a, slot, rank)


def _add_rows(x: Tensor, out: Tensor, a: LoRAArgs, rank: int) -> None:
    """BGMV: on a CPU ``cpu.lora_bgmv``'s C loop (each row reads its own
    slot in place, rows grouped by slot once per step); elsewhere, or where
    it cannot be built, two dense GEMMs over the whole table, all but each
    row's own slot masked out (cheaper than a copy of A and B gathered per
    row, and fixed in shape)."""
    rows = x.shape[0]
    if x.device.type == "cpu":
        plan = a.mapping.memo.get("bgmv")
        if plan is None:  # once per step, not per projection
            plan = a.mapping.memo["bgmv"] = lora_bgmv.plan(a.mapping.token_slots[:rows])
        table = _derived(a.lora_b, ("bgmv", id(a.lora_a), a.slice_sizes), lambda b: _bgmv_table(a, b, rank))
        if table is not None and lora_bgmv.add_rows(x, out, table, plan):
            return
    slots, stacked, in_features = a.lora_a.shape
    key = ("own", rows, slots, x.device, x.dtype)
    own = a.mapping.memo.get(key)
    if own is None:  # once per step, not per projection
        arange = torch.arange(slots, device=x.device)
        own = a.mapping.memo[key] = (a.mapping.token_slots[:rows, None] == arange)[:, :, None].to(x.dtype)
    h = F.linear(x, a.lora_a.view(slots * stacked, in_features))
    h.view(rows, slots, stacked).mul_(own)
    out.addmm_(h, _expand_matrix(a.lora_b, a.slice_sizes, rank))


def _bgmv_table(a: LoRAArgs, lora_b: Tensor, rank: int) -> lora_bgmv.Table | None:
    """The C kernel's view of the projection's table (None: it does not apply)."""
    if lora_bgmv.pairs(lora_b.dtype):  # bf16: lora_b's rank pairs side by side
        table = lora_bgmv.pair_table(lora_b) if rank % 2 == 0 else lora_b
    else:
        table = _expand_matrix(lora_b, a.slice_sizes, rank)
    return lora_bgmv.prepare(a.lora_a, table, a.slice_sizes)


def _add_run(x: Tensor, out: Tensor, a: LoRAArgs, slot: int, rank: int) -> None:
    """SGMV's result for one run of rows of one adapter: a GEMM pair."""
    h = F.linear(x, a.lora_a[slot])
    per_slot = len(a.slice_sizes) * rank
    out.addmm_(h, _expand_matrix(a.lora_b, a.slice_sizes, rank)[slot * per_slot : (slot + 1) * per_slot])


# (lora_b's id, what was derived) -> (a weak reference to it, its version, what was derived)
_DERIVED: dict[tuple[int, Any], tuple[weakref.ref[Tensor], int, Any]] = {}
D = TypeVar("D")


def _derived(lora_b: Tensor, kind: Any, build: Callable[[Tensor], D]) -> D:
    """``build(lora_b)``, kept (under ``kind``) until a slot is written
    (``lora_b._version``); an inference tensor has no version: built each call."""
    version = -1 if lora_b.is_inference() else lora_b._version
    cached = _DERIVED.get((id(lora_b), kind))
    if cached is not None and cached[0]() is lora_b and cached[1] == version >= 0:
        return cached[2]  # type: ignore[no-any-return]
    derived = build(lora_b)
    if version >= 0:
        for dead in [k for k, (ref, _, _) in _DERIVED.items() if ref() is None]:
            del _DERIVED[dead]
        _DERIVED[(id(lora_b), kind)] = (weakref.ref(lora_b), version, derived)
    return derived


def _expand_matrix(lora_b: Tensor, slice_sizes: tuple[int, ...], rank: int) -> Tensor:
    """``lora_b`` as one ``[slots * S * R, out]`` matrix whose rows line up
    with the shrink's ``(slot, projection, r)`` columns (zero where a row's
    projection is not the column's), so every stacked projection expands in
    one GEMM added in place: on a CPU several small GEMMs and their copies
    cost more than the zeros. Kept until a slot is written."""

    def build(lora_b: Tensor) -> Tensor:
        out_features, slots, _ = lora_b.shape
        big = lora_b.new_zeros(out_features, slots, len(slice_sizes), rank)
        start = 0
        for i, size in enumerate(slice_sizes):
            big[start : start + size, :, i] = lora_b[start : start + size]
            start += size
        return big.view(out_features, -1).t().contiguous()

    return _derived(lora_b, ("expand", slice_sizes, rank), build)
