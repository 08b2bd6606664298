"""One flat step's attention metadata, built once and read by every layer.

A step is a flat batch of tokens: sequence ``b`` contributes ``new_lens[b]``
consecutive tokens that start at its cached length ``starts[b]``. Its K/V
go to ``slot_mapping`` (``block_id * block_size + offset``). Sequences with
one new token (decodes, or a last prompt token) form the *decode part* and
the rest the *prefill part*; each part is handed to its attention op. When
the decode sequences do not come first, ``rows`` lists each part's token
rows so queries can be taken out and outputs put back; the runner orders
its batch decode-first so that no such copy is needed.

Everything is built on the host (numpy) and moved to the device in one
copy, so nothing in the forward pass syncs with the host to learn the layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor


@dataclass(slots=True)
class DecodePart:
    """Sequences with exactly one query: ``paged_decode_attention``'s arguments."""

    rows: Tensor | None  # [num_decodes] token rows; None: rows 0..num_decodes
    block_tables: Tensor  # [num_decodes, width] int32
    seq_lens: Tensor  # [num_decodes] int32, including the new token


@dataclass(slots=True)
class PrefillPart:
    """Sequences with several queries: ``paged_prefill_attention``'s arguments."""

    rows: Tensor | None  # [num_prefill_tokens] token rows; None: the rows after the decodes
    block_tables: Tensor  # [num_prefills, width] int32
    cu_seqlens_q: Tensor  # [num_prefills + 1] int32, from 0
    seq_lens: Tensor  # [num_prefills] int32: cached + new


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step layout shared by every layer (see module doc)."""

    starts: list[int]
    new_lens: list[int]
    positions: Tensor  # [num_tokens] long: absolute position of each token
    slot_mapping: Tensor  # [num_tokens] long
    block_tables: Tensor  # [batch, width] int32, in the caller's sequence order
    seq_lens: Tensor  # [batch] int32: starts + new_lens
    decode: DecodePart | None
    prefill: PrefillPart | None
    # Derived tensors the attention ops reuse across layers (gather plans, masks).
    memo: dict[Any, Any] = field(default_factory=dict)
    # KV cache groups 1.. of a hybrid pool (this object is group 0's): each
    # has its own page tables and slot mapping. Empty with one group.
    groups: list[AttentionMetadata] = field(default_factory=list)

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata layers of KV cache group ``group`` read."""
        return self.groups[group - 1] if group else self

    def all_groups(self) -> list[AttentionMetadata]:
        """Every group's metadata, group 0 first."""
        return [self, *self.groups]

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    def prefill_key_reads(self) -> int:
        """Keys the prefill part's queries read in all, each query at
        position ``p`` reading ``p + 1`` (a window only lowers it): what
        attending each prompt row as a decode of its own costs."""
        return sum(
            n * start + n * (n + 1) // 2
            for start, n in zip(self.starts, self.new_lens, strict=True)
            if n > 1
        )

    def as_decodes(self) -> DecodePart:
        """Every token row as a decode of its own, in row order: row ``i`` of
        sequence ``b`` at position ``p`` reads ``b``'s page table up to
        ``p + 1`` keys, which is the causal prefill's mask. Made once per
        step (kept in ``memo``)."""
        part = self.memo.get("as_decodes")
        if part is None:
            seq_of_row = np.repeat(np.arange(len(self.new_lens)), self.new_lens)
            index = torch.from_numpy(seq_of_row).to(self.block_tables.device)
            part = self.memo["as_decodes"] = DecodePart(
                None, self.block_tables.index_select(0, index), (self.positions + 1).to(torch.int32)
            )
        return part  # type: ignore[no-any-return]


def build_metadata(
    block_tables: Tensor | np.ndarray,
    starts: Sequence[int],
    new_lens: Sequence[int],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for sequences whose page tables are the rows of ``block_tables``
    (``[batch, width]`` int32 on the host, numpy or torch, covering every token of this step;
    ``[groups, batch, width]`` for a hybrid pool's KV cache groups, which
    share everything but their tables and slot mappings).

    Built with numpy on the host (a small array op costs ~1 us there, ~10 us
    as a torch op) and moved to ``device`` in one copy, every group at once."""
    tables = np.asarray(block_tables)
    if tables.ndim == 2:
        tables = tables[None]
    batch = len(starts)
    start_a = np.asarray(starts, dtype=np.int64)
    new_a = np.asarray(new_lens, dtype=np.int64)
    host: dict[str, np.ndarray] = {"block_tables": tables}
    if batch and new_a.min() == 1 == new_a.max():  # a pure decode step: one token each
        seq_of_token = np.arange(batch)
        positions = start_a
        token_start = seq_of_token
    else:
        cu = np.zeros(batch + 1, dtype=np.int64)
        np.cumsum(new_a, out=cu[1:])
        seq_of_token = np.repeat(np.arange(batch), new_a)
        token_start = cu[:-1]
        positions = start_a[seq_of_token] + np.arange(int(cu[-1])) - token_start[seq_of_token]
    host["positions"] = positions
    host["slot_mapping"] = (
        tables[:, seq_of_token, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    seq_lens = (start_a + new_a).astype(np.int32)
    host["seq_lens"] = seq_lens

    is_decode = new_a == 1
    decodes = np.flatnonzero(is_decode)
    prefills = np.flatnonzero(~is_decode & (new_a > 0))
    num_decodes = len(decodes)
    in_order = bool(num_decodes == 0 or decodes[-1] == num_decodes - 1)
    # In order, each part is a slice of the batch (views, no copies).
    dec_idx = slice(0, num_decodes) if in_order else decodes
    pre_idx = slice(num_decodes, num_decodes + len(prefills)) if in_order else prefills
    if num_decodes:
        host["decode_block_tables"] = tables[:, dec_idx]
        host["decode_seq_lens"] = seq_lens[dec_idx]
        if not in_order:
            host["decode_rows"] = token_start[decodes]
    if len(prefills):
        q_lens = new_a[pre_idx]
        cu_q = np.zeros(len(prefills) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu_q[1:])
        host["prefill_block_tables"] = tables[:, pre_idx]
        host["prefill_cu_seqlens_q"] = cu_q
        host["prefill_seq_lens"] = seq_lens[pre_idx]
        if not in_order:
            host["prefill_rows"] = np.repeat(token_start[prefills], q_lens) + (
                np.arange(int(cu_q[-1])) - np.repeat(cu_q[:-1].astype(np.int64), q_lens)
            )
    t = to_device(host, device)
    metas = []
    for g in range(tables.shape[0]):  # what differs by group: tables and slot mapping
        decode = prefill = None
        if num_decodes:
            decode = DecodePart(t.get("decode_rows"), t["decode_block_tables"][g], t["decode_seq_lens"])
        if len(prefills):
            prefill = PrefillPart(
                t.get("prefill_rows"),
                t["prefill_block_tables"][g],
                t["prefill_cu_seqlens_q"],
                t["prefill_seq_lens"],
            )
        metas.append(
            AttentionMetadata(
                starts=list(starts),
                new_lens=list(new_lens),
                positions=t["positions"],
                slot_mapping=t["slot_mapping"][g],
                block_tables=t["block_tables"][g],
                seq_lens=t["seq_lens"],
                decode=decode,
                prefill=prefill,
            )
        )
    return with_groups(metas)


def with_groups(metas: list[AttentionMetadata]) -> AttentionMetadata:
    """One step's metadata for every KV cache group: the first group's,
    carrying all of them (just it when there is one group)."""
    metas[0].groups = metas[1:]
    return metas[0]


def to_device(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, Tensor]:
    """Host arrays as tensors on ``device``: zero-copy views on the CPU; else
    packed into one byte buffer, copied once, and cut into typed views."""
    if device.type == "cpu":
        return {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in arrays.items()}
    offsets: dict[str, tuple[int, np.ndarray]] = {}
    size = 0
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        size = -(-size // 8) * 8  # every view starts 8-byte aligned
        offsets[name] = (size, a)
        size += a.nbytes
    staging = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    host = staging.numpy()
    for start, a in offsets.values():
        host[start : start + a.nbytes] = a.view(np.uint8).reshape(-1)
    packed = staging.to(device, non_blocking=True)
    out = {}
    for name, (start, a) in offsets.items():
        dtype = torch.from_numpy(a[:0]).dtype
        out[name] = packed[start : start + a.nbytes].view(dtype).view(a.shape)
    return out
