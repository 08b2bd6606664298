"""One flat step's attention metadata, built once and read by every layer.

A step is a flat batch of tokens: sequence ``b`` contributes ``new_lens[b]``
consecutive tokens that start at its cached length ``starts[b]``. Its K/V
go to ``slot_mapping`` (``block_id * block_size + offset``). Sequences with
one new token (decodes, or a last prompt token) form the *decode part* and
the rest the *prefill part*; each part is handed to its attention op. When
the decode sequences do not come first, ``rows`` lists each part's token
rows so queries can be taken out and outputs put back; the runner orders
its batch decode-first so that no such copy is needed.

Everything is built on the host and moved to the device once, so nothing in
the forward pass syncs with the host to find out the layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def build_metadata(
    block_tables: Tensor,
    starts: Sequence[int],
    new_lens: Sequence[int],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for sequences whose page tables are the rows of ``block_tables``
    (``[batch, width]`` int32 on the host, covering every token of this step)."""
    batch = len(starts)
    start_t = torch.tensor(starts, dtype=torch.long)
    new_t = torch.tensor(new_lens, dtype=torch.long)
    cu = torch.zeros(batch + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(new_t, 0)
    num_tokens = int(cu[-1])
    seq_of_token = torch.repeat_interleave(torch.arange(batch), new_t)
    positions = start_t[seq_of_token] + torch.arange(num_tokens) - cu[:-1][seq_of_token]
    tables = block_tables.to(torch.long)
    slot_mapping = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    seq_lens = (start_t + new_t).to(torch.int32)

    decodes = [b for b, n in enumerate(new_lens) if n == 1]
    prefills = [b for b, n in enumerate(new_lens) if n > 1]
    in_order = decodes == list(range(len(decodes)))
    decode = prefill = None
    if decodes:
        idx = slice(0, len(decodes)) if in_order else torch.tensor(decodes)
        decode = DecodePart(
            rows=None if in_order else cu[:-1][idx].to(device),
            block_tables=block_tables[idx].to(device),
            seq_lens=seq_lens[idx].to(device),
        )
    if prefills:
        idx = slice(len(decodes), batch) if in_order else torch.tensor(prefills)
        q_lens = new_t[idx]
        cu_q = torch.zeros(len(prefills) + 1, dtype=torch.int32)
        cu_q[1:] = torch.cumsum(q_lens, 0)
        rows = None
        if not in_order:
            rows = torch.repeat_interleave(cu[:-1][idx], q_lens) + (
                torch.arange(int(cu_q[-1])) - torch.repeat_interleave(cu_q[:-1].long(), q_lens)
            )
        prefill = PrefillPart(
            rows=None if rows is None else rows.to(device),
            block_tables=block_tables[idx].to(device),
            cu_seqlens_q=cu_q.to(device),
            seq_lens=seq_lens[idx].to(device),
        )
    return AttentionMetadata(
        starts=list(starts),
        new_lens=list(new_lens),
        positions=positions.to(device),
        slot_mapping=slot_mapping.to(device),
        block_tables=block_tables.to(device),
        seq_lens=seq_lens.to(device),
        decode=decode,
        prefill=prefill,
    )
