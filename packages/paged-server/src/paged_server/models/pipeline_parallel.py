"""Pipeline-parallel building blocks: which layers a stage holds.

vLLM's split (``get_pp_indices``): each of ``size`` stages gets
``num_layers // size`` contiguous layers, and the remainder goes one layer
each to the stages just before the last (the last one also runs the final
norm and the LM head). The first stage holds the embeddings. A stage's
model keeps every layer index (weight names stay ``model.layers.{i}``):
the layers of other stages are ``MissingLayer`` placeholders without
weights, so the loader reads only this stage's tensors from the checkpoint.

Our decoder layers carry the residual stream in their output (no separate
residual tensor as in vLLM's fused add-norm layers), so the activation
passed from stage to stage is one ``[num_tokens, hidden]`` tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from paged_server.models.errors import InvalidConfigError


def stage_layers(num_layers: int, rank: int, size: int) -> range:
    """Stage ``rank`` of ``size``'s layers (vLLM's ``get_pp_indices``).
    Raises ``InvalidConfigError`` when some stage would get no layer."""
    if size > num_layers:
        raise InvalidConfigError(
            f"pipeline_parallel_size ({size}) exceeds the model's {num_layers} layers: every "
            f"stage needs at least one layer; choose a pipeline_parallel_size <= {num_layers}"
        )
    parts = [num_layers // size] * size
    for i in range(2, num_layers % size + 2):  # the remainder, before the last stage
        parts[-i] += 1
    start = sum(parts[:rank])
    return range(start, start + parts[rank])


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """Stage ``rank`` of ``size``, holding ``layers`` of the model's
    ``num_layers`` (0 until the model fills it in: ``for_stage``)."""

    rank: int = 0
    size: int = 1
    num_layers: int = 0

    @property
    def layers(self) -> range:
        return stage_layers(self.num_layers, self.rank, self.size)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def holds_embedding(self, tied: bool) -> bool:
        """The first stage embeds the tokens; with ``tied`` (the LM head is
        the embedding matrix) the last stage holds the matrix too."""
        return self.is_first or (self.is_last and tied)

    def layer_modules(self, make: Callable[[int], nn.Module]) -> nn.ModuleList:
        """Every layer index: ``make(i)`` for this stage's layers, a
        ``MissingLayer`` for the others' (weight names keep their index)."""
        mine = self.layers
        return nn.ModuleList(make(i) if i in mine else MissingLayer() for i in range(self.num_layers))

    def holds_weight(self, name: str, tied: bool) -> bool:
        """Whether checkpoint tensor ``name`` (our weight name) belongs to
        this stage (``tied``: the LM head is the embedding matrix, which
        the last stage then holds too)."""
        if self.size == 1:
            return True
        if (layer := _LAYER.match(name)) is not None:
            return int(layer[1]) in self.layers
        if name.startswith("model.embed_tokens."):
            return self.holds_embedding(tied)
        if name.startswith(("model.norm.", "lm_head.")):
            return self.is_last
        return True


WHOLE = PipelineStage()
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def for_stage(stage: PipelineStage, num_layers: int) -> PipelineStage:
    """``stage`` with the model's layer count filled in (checked)."""
    if stage.size > 1:
        stage_layers(num_layers, stage.rank, stage.size)  # raises when it cannot split
    return PipelineStage(stage.rank, stage.size, num_layers)


class MissingLayer(nn.Module):
    """A layer another stage holds: no weights; never called."""

    def forward(self, *args: object) -> None:
        raise RuntimeError("this layer belongs to another pipeline stage")
