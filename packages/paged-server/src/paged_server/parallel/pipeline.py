"""Pipeline parallelism: one step through every stage, point to point.

Every rank runs ``PipelineStep.run`` once per step, after rank 0's step
message (``step_message.py``): a stage after the first receives the
previous stage's activations (``[num_tokens, hidden]`` in the model
dtype, from the rank with its tensor-parallel rank in that stage), runs its
layers and sends them on; the last stage runs the final norm and the LM
head on the rows the engine samples and its first rank sends the float32
logits to rank 0, which samples. So rank 0 (the engine: scheduler, block
manager, sampler) is also the first stage, as in vLLM's driver.

Synchronous: one step flows through all stages before the next begins,
so at PP=N each stage idles (N-1)/N of the time. Several micro-batches in
flight would fill the pipeline; the scheduler does not form them yet
(docs/operations.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from paged_server.models.base import CausalLM
from paged_server.parallel.process_groups import TPGroup


class PipelineStep:
    """This rank's stage of each step (every rank of a pipelined engine has one)."""

    def __init__(self, model: CausalLM, group: TPGroup, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.group = model, group
        self.dtype, self.device = dtype, device
        tp = group.tp_size
        self.stage = model.pp
        self.prev = group.rank - tp  # same tensor-parallel rank, one stage earlier
        self.next = group.rank + tp
        self.last_rank = (self.stage.size - 1) * tp  # the last stage's first rank sends logits

    def run(self, ids: Tensor, positions: Tensor, view: object, rows: Tensor) -> Tensor | None:
        """Run this stage over the step's tokens; rank 0 returns the logits
        ``[len(rows), vocab]`` of the rows sampled (from the last stage),
        every other rank None."""
        stage, group = self.stage, self.group
        intermediate = None
        if not stage.is_first:
            intermediate = torch.empty(
                ids.shape[0], self.model.config.hidden_size, dtype=self.dtype, device=self.device
            )
            group.recv(intermediate, self.prev)
        hidden = self.model.hidden_states(ids, positions, view, intermediate)  # type: ignore[arg-type]
        num_rows = rows.shape[0]
        if not stage.is_last:
            group.send(hidden, self.next)
        elif group.rank == self.last_rank and num_rows:
            group.send(self.model.compute_logits(hidden.index_select(0, rows)), 0)
        if group.rank != 0:
            return None
        logits = torch.empty(num_rows, self.model.config.vocab_size, dtype=torch.float32, device=self.device)
        return group.recv(logits, self.last_rank) if num_rows else logits
