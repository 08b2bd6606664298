"""Pipeline parallelism: one step through every stage, in micro-batches.

Every rank runs ``PipelineStep.run`` once per step, after rank 0's step
message (``step_message.py``). The step's sequences are cut into up to
``micro_batches`` runs of whole sequences (``split_batch``: decodes and
prefill chunks as the runner ordered them, about equal tokens each), and
each micro-batch flows through the stages on its own: a stage after the
first receives the previous stage's activations for it (``[tokens,
hidden]`` in the model dtype, from the rank with its tensor-parallel rank
in that stage), runs its layers, starts sending them on and goes to the
next micro-batch; so while stage 1 runs micro-batch 0, stage 0 already
runs micro-batch 1. The last stage runs the final norm and the LM head on
each micro-batch's sampled rows and its first rank sends the float32
logits to rank 0, which puts them back in the step's row order and
samples. So rank 0 (the engine: scheduler, block manager, sampler) is also
the first stage, as in vLLM's driver.

Transfers are non-blocking (``TPGroup.isend``/``irecv``): gloo completes a
send only once the receiver has posted it, so a blocking send would make a
stage wait for the next to finish the micro-batch before. Receives are
posted for the whole step up front, and every transfer is waited on before
``run`` returns. Each micro-batch has its own metadata (``build_metadata``
over its rows of the step's page tables), so its sequences write their own
blocks and attend to their own context; the cut is a pure function of the
step's token counts, the same on every rank.

The pipeline still drains at the end of each step (the engine samples
before it schedules the next), so at P stages and M micro-batches of equal
cost a stage idles (P-1)/(M+P-1) of the step instead of (P-1)/P.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from paged_server.models.base import CausalLM
from paged_server.parallel.process_groups import Pending, TPGroup

if TYPE_CHECKING:
    from paged_ref.cache_view import CacheView

# Internal knob (vLLM has no flag for it): micro-batches per step; the
# default is one per stage. 1 is the synchronous schedule.
MICRO_BATCHES_ENV = "PAGED_PP_MICRO_BATCHES"


def micro_batch_count(pipeline_parallel_size: int) -> int:
    """Micro-batches per step: ``PAGED_PP_MICRO_BATCHES``, else one per stage."""
    text = os.environ.get(MICRO_BATCHES_ENV, "").strip()
    if not text:
        return pipeline_parallel_size
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{MICRO_BATCHES_ENV} must be an integer >= 1, got {text!r}")
    return int(text)


def split_batch(new_lens: Sequence[int], count: int) -> list[int]:
    """Cut a step of ``len(new_lens)`` sequences (``new_lens[b]`` tokens
    each, in the runner's order) into ``min(count, batch)`` runs of whole
    sequences with about equal tokens; returns the sequence bounds
    ``[0, ..., batch]``. A run closes once it reaches its share of the
    tokens, or when each remaining sequence must be a run of its own."""
    batch = len(new_lens)
    parts = min(count, batch)
    if parts <= 1:
        return [0, batch]
    total = sum(new_lens)
    bounds, done = [0], 0
    for i, n in enumerate(new_lens[:-1]):
        done += n
        cuts_left = parts - len(bounds)
        if cuts_left and (done * parts >= total * len(bounds) or batch - i - 1 <= cuts_left):
            bounds.append(i + 1)
    bounds.append(batch)
    return bounds


@dataclass(slots=True)
class MicroBatch:
    """Some consecutive sequences of a step, as one forward pass sees them."""

    ids: Tensor  # its token ids
    view: CacheView  # its sequences' metadata over this rank's pool
    rows: Tensor  # the rows it samples, numbered within it
    out: list[int]  # where those rows' logits go in the step's


class PipelineStep:
    """This rank's stage of each step (every rank of a pipelined engine has one);
    ``micro_batches``: how many the step is cut into at most (every rank alike)."""

    def __init__(
        self, model: CausalLM, group: TPGroup, dtype: torch.dtype, device: torch.device,
        block_size: int, micro_batches: int = 1,
    ) -> None:  # fmt: skip
        self.model, self.group = model, group
        self.dtype, self.device = dtype, device
        self.block_size = block_size
        self.micro_batches = micro_batches
        tp = group.tp_size
        self.stage = model.pp
        self.prev = group.rank - tp  # same tensor-parallel rank, one stage earlier
        self.next = group.rank + tp
        self.last_rank = (self.stage.size - 1) * tp  # the last stage's first rank sends logits

    def run(self, ids: Tensor, view: CacheView, rows: Sequence[int]) -> Tensor | None:
        """Run this stage over the step's tokens (``view``: the whole step's);
        rank 0 returns the logits ``[len(rows), vocab]`` of the step's rows
        ``rows`` (from the last stage), every other rank None."""
        stage, group, config = self.stage, self.group, self.model.config
        batches = list(self._cut(ids, view, rows))
        inbox: list[Pending] = []
        if not stage.is_first:  # every receive posted now: transfers run while we compute
            inbox = [
                group.irecv(self._empty(mb.ids.shape[0], config.hidden_size, self.dtype), self.prev, tag)
                for tag, mb in enumerate(batches)
            ]
        logits_in: dict[int, Pending] = {}
        if group.rank == 0:
            logits_in = {
                tag: group.irecv(self._empty(len(mb.out), config.vocab_size, torch.float32), self.last_rank, tag)
                for tag, mb in enumerate(batches) if mb.out
            }  # fmt: skip
        outbox: list[Pending] = []
        for tag, mb in enumerate(batches):
            intermediate = inbox[tag].wait() if inbox else None
            hidden = self.model.hidden_states(mb.ids, mb.view.meta.positions, mb.view, intermediate)  # type: ignore[arg-type]
            if not stage.is_last:
                outbox.append(group.isend(hidden, self.next, tag))
            elif group.rank == self.last_rank and mb.out:
                outbox.append(group.isend(self.model.compute_logits(hidden.index_select(0, mb.rows)), 0, tag))
        for pending in outbox:
            pending.wait()
        if group.rank != 0:
            return None
        if len(batches) == 1:  # its rows are the step's, in order
            return logits_in[0].wait() if logits_in else self._empty(0, config.vocab_size, torch.float32)
        logits = self._empty(len(rows), config.vocab_size, torch.float32)
        for tag, pending in logits_in.items():
            logits[batches[tag].out] = pending.wait()
        return logits

    def _cut(self, ids: Tensor, view: CacheView, rows: Sequence[int]) -> Iterator[MicroBatch]:
        """The step as micro-batches (just the step when it stays whole)."""
        # Imported here, as in worker.py: a worker reports that it started
        # before it imports the attention code, so a broken install is named.
        from paged_ref.attention_metadata import build_metadata
        from paged_ref.cache_view import CacheView

        meta = view.meta
        bounds = split_batch(meta.new_lens, self.micro_batches)
        if len(bounds) == 2:
            yield MicroBatch(ids, view, self._rows(rows), list(range(len(rows))))
            return
        # Every KV cache group's page tables, on the host: [groups, batch, width].
        tables = torch.stack([m.block_tables for m in meta.all_groups()]).cpu()
        first_token = 0
        for a, b in zip(bounds, bounds[1:], strict=False):
            num_tokens = sum(meta.new_lens[a:b])
            end = first_token + num_tokens
            out = [j for j, row in enumerate(rows) if first_token <= row < end]
            sub = build_metadata(tables[:, a:b], meta.starts[a:b], meta.new_lens[a:b], self.block_size, self.device)
            yield MicroBatch(
                ids[first_token:end],
                CacheView.over(view.tensors, sub),
                self._rows([rows[j] - first_token for j in out]),
                out,
            )
            first_token = end

    def _rows(self, rows: Sequence[int]) -> Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _empty(self, num_rows: int, width: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(num_rows, width, dtype=dtype, device=self.device)
