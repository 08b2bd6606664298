"""The projections of the model families, and which checkpoint tensors fill them.

Every projection is one GEMM. Where a checkpoint stores several projections
that read the same input (q/k/v, gate/up), the layer holds them stacked as
one weight, as vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear`` do: one matrix product instead of three or
two, the output split by views. (Measured on a 2-core EPYC, torch 2.13,
one thread, fp32, the 100M bench model's shapes at 8-32 tokens: qkv fused
1.0x, gate_up fused 0.8x of two half-width GEMMs in eager mode; fusion pays
on a GPU, one launch instead of three or two.)

The loader learns where each checkpoint tensor goes from the layer itself
(``checkpoint_tensors``): a ``Part`` per tensor names the parameter it
fills and, with tensor parallelism, which rows (or columns) of it this rank
holds and where they land in the stacked weight. So the loader has no table
of fused names, each part is sharded on its own (a rank holds its q heads,
its k heads and its v heads, stacked), and a layer that stores its weight
in another format (quantized checkpoints: packed weights and
their scales) plugs in at the same seam by naming other tensors.

Both kinds take the step's ``LoRAMapping`` (``lora``) beside the input:
with one, and a slot table ``models.lora.attach`` gave the layer, every
row's adapter delta is added to the output (a row-parallel layer's before
its all-reduce); with none, the layer is the plain GEMM it always was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from paged_server.models import few_row_gemm
from paged_server.models.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from paged_ref.lora_ops import LoRAMapping
    from paged_server.models.lora.layers import LoRAWeights


@dataclass(frozen=True, slots=True)
class Part:
    """Where one checkpoint tensor (or a piece of it) goes: into ``param``
    (an attribute of the layer), whole when ``dim`` is None; else the slice
    ``[start, start + size)`` along ``dim`` of a tensor ``full`` wide there,
    written at ``offset`` along ``dim`` of the parameter. ``index``: the
    parameter stacks one such tensor per index along its first dimension
    (a mixture of experts' weights), and this one is ``param[index]``."""

    param: str
    dim: int | None = None
    start: int = 0
    size: int = 0
    full: int = 0
    offset: int = 0
    index: int | None = None


@dataclass(frozen=True, slots=True)
class OutputSlice:
    """One projection stacked in a column-parallel layer: named ``name`` in
    the checkpoint, ``full`` output features there, of which this rank holds
    ``size`` from ``start``. Checkpoints that store the projections already
    stacked (Phi-3's ``qkv_proj``) name one tensor in several slices, each
    with its ``start`` inside the stacked tensor."""

    name: str
    full: int
    start: int
    size: int


def stored_stacked(name: str, slices: list[OutputSlice]) -> list[OutputSlice]:
    """``slices`` as a checkpoint that stores them stacked, in this order,
    as one tensor ``name`` (Phi-3's ``qkv_proj`` and ``gate_up_proj``):
    each slice's rows then start at its projection's place in that tensor."""
    total = sum(s.full for s in slices)
    out, at = [], 0
    for s in slices:
        out.append(OutputSlice(name, total, at + s.start, s.size))
        at += s.full
    return out


class ColumnParallelLinear(nn.Linear):
    """One or more projections of the same input, stacked along the output
    features: each ``OutputSlice`` is the rank's share of one checkpoint
    tensor (weight and bias sliced along dim 0). No communication.
    ``split`` cuts the output back into the projections."""

    lora_weights: LoRAWeights | None = None  # the adapters' slot table (models.lora.attach)

    def __init__(self, in_features: int, slices: list[OutputSlice], bias: bool) -> None:
        super().__init__(in_features, sum(s.size for s in slices), bias=bias)
        self.slices = slices

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        out = few_row_gemm.linear(self, x, self.bias)
        if lora is not None:
            _lora_delta(self, x, out, lora)
        return out

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The output as one tensor per stacked projection (views)."""
        return out.split([s.size for s in self.slices], dim=-1)

    def checkpoint_tensors(self, name: str) -> list[tuple[str, Part]]:
        """(checkpoint tensor name, ``Part``) pairs; names are relative to
        the parent module (``name`` is this layer's own, used when it holds
        one projection). A name may come more than once: one tensor cut
        into several slices (a checkpoint's stacked projections)."""
        return stacked_parts(name, self.slices, self.bias is not None)


def stacked_parts(
    name: str, slices: list[OutputSlice], bias: bool, params: tuple[str, ...] = ("weight",)
) -> list[tuple[str, Part]]:
    """The checkpoint tensors of projections stacked along dim 0 in
    ``slices`` order: each slice's rows of its tensor, at its offset."""
    parts: list[tuple[str, Part]] = []
    offset = 0
    for s in slices:
        prefix = name if len(slices) == 1 else s.name
        for param in params + (("bias",) if bias else ()):
            parts.append((f"{prefix}.{param}", Part(param, 0, s.start, s.size, s.full, offset)))
        offset += s.size
    return parts


class RowParallelLinear(nn.Linear):
    """Input features ``[start, start + size)`` of a ``full_size``-wide layer
    (weight sliced along dim 1; the bias is whole and added once, after the
    all-reduce that sums the ranks' partial products)."""

    lora_weights: LoRAWeights | None = None  # the adapters' slot table (models.lora.attach)

    def __init__(
        self,
        full_size: int,
        out_features: int,
        start: int,
        size: int,
        bias: bool,
        tp: TensorParallel,
    ) -> None:
        super().__init__(size, out_features, bias=bias)
        self.shard_start, self.full_size = start, full_size
        self.tp = tp

    def checkpoint_tensors(self, name: str) -> list[tuple[str, Part]]:
        """As ``ColumnParallelLinear.checkpoint_tensors``: the weight's
        columns of this rank, the bias whole."""
        parts = [
            (f"{name}.weight", Part("weight", 1, self.shard_start, self.in_features, self.full_size))
        ]
        if self.bias is not None:
            parts.append((f"{name}.bias", Part("bias")))
        return parts

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        if self.tp.world_size == 1:
            out = few_row_gemm.linear(self, x, self.bias)
            if lora is not None:
                _lora_delta(self, x, out, lora)
            return out
        out = few_row_gemm.linear(self, x, None)
        if lora is not None:  # this rank's share of the delta, summed with the product
            _lora_delta(self, x, out, lora)
        out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias


def _lora_delta(
    layer: ColumnParallelLinear | RowParallelLinear,
    x: torch.Tensor,
    out: torch.Tensor,
    lora: LoRAMapping,
) -> None:
    """Add the step's adapter deltas to ``layer``'s output ``out``, if the
    layer has a slot table (a model without ``models.lora.attach`` has none)."""
    if layer.lora_weights is not None:
        layer.lora_weights.apply(x, out, lora)


def attach_few_row_weights(model: nn.Module) -> int:
    """Give every bf16 projection of ``model`` (its stacked column- and
    row-parallel layers, and its LM head) a copy of its weight packed for
    ``few_row_gemm``, which their forward then runs at 1-8 rows, where
    this CPU prefers the kernel and the layer has none yet; how many it
    gave one."""
    if not few_row_gemm.preferred():
        return 0
    lm_head = getattr(model, "lm_head", None)
    count = 0
    for module in model.modules():
        served = isinstance(module, ColumnParallelLinear | RowParallelLinear) or module is lm_head
        fresh = not hasattr(module, "few_row_weight")
        if served and fresh and isinstance(module, nn.Linear) and few_row_gemm.applies(module.weight):
            module.register_buffer("few_row_weight", few_row_gemm.pack(module.weight), persistent=False)
            count += 1
    return count
