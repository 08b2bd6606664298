"""Model runner: token lists in, one row of logits per sequence out.

Builds ``input_ids``/``position_ids`` (each sequence's positions start at
its slot's cached length), asks the pool for the right view (decode,
single prefill, or right-padded batched prefill), runs the model under
``torch.inference_mode()``, and applies the LM head only to the rows that
are sampled. Knows nothing of sampling, stops or scheduling.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from paged_core.protocols import ServingPoolProtocol
from paged_server.sequence import Sequence


class ModelRunner:
    """Runs forward passes for the engine over one cache pool."""

    def __init__(self, model: nn.Module, pool: ServingPoolProtocol, device: torch.device) -> None:
        self.model = model
        self.pool = pool
        self.device = device

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> Tensor:
        """One new token per sequence (its last sampled token, already reserved
        with ``append_token``); returns logits ``[len(seqs), vocab]``."""
        slots = [self._slot(s) for s in seqs]
        input_ids = self._tensor([[s.token_ids[s.num_computed]] for s in seqs])
        position_ids = self._tensor([[s.num_computed] for s in seqs])
        view = self.pool.decode_view(slots)
        logits = self._forward(input_ids, position_ids, view, [0] * len(seqs))
        for s in seqs:
            s.num_computed += 1
        return logits

    @torch.inference_mode()
    def prefill(self, chunks: list[tuple[Sequence, int]]) -> Tensor:
        """The next ``n`` uncomputed tokens of each sequence; returns logits
        ``[len(chunks), vocab]`` at each chunk's last token (only meaningful
        where the chunk completes the sequence's prefill)."""
        slots = [self._slot(s) for s, _ in chunks]
        lens = [n for _, n in chunks]
        width = max(lens)
        rows, positions = [], []
        for seq, n in chunks:
            start = seq.num_computed
            rows.append(seq.token_ids[start : start + n] + [0] * (width - n))
            # Padding repeats the last real position (any valid position would do).
            positions.append([start + min(i, n - 1) for i in range(width)])
        if len(chunks) == 1:
            view = self.pool.prefill_view(slots[0])
        else:
            view = self.pool.batched_prefill_view(slots, lens)
        logits = self._forward(
            self._tensor(rows), self._tensor(positions), view, [n - 1 for n in lens]
        )
        for seq, n in chunks:
            seq.num_computed += n
        return logits

    def _forward(
        self, input_ids: Tensor, position_ids: Tensor, view: object, last: list[int]
    ) -> Tensor:
        """Hidden states for all positions, LM head only at ``last[i]`` of row ``i``."""
        model = self.model
        hidden = model.hidden_states(input_ids, position_ids, view)  # type: ignore[operator]
        rows = torch.arange(len(last), device=hidden.device)
        picked = hidden[rows, torch.tensor(last, device=hidden.device)]
        return model.compute_logits(picked)  # type: ignore[operator, no-any-return]

    def _slot(self, seq: Sequence) -> int:
        assert seq.slot is not None, f"sequence {seq.seq_id} has no cache slot"
        cached = self.pool.get_seq_len(seq.slot)
        assert cached == seq.num_computed, (
            f"sequence {seq.seq_id}: pool holds {cached} tokens, engine expects {seq.num_computed}"
        )
        return seq.slot

    def _tensor(self, data: list[list[int]]) -> Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)
