"""LoRA on the projections: each one's slot table, and where an adapter's
factors go in it on this rank.

``attach`` gives every ``ColumnParallelLinear`` (q/k/v, gate/up) and
``RowParallelLinear`` (o, down) of a model a ``LoRAWeights``: ``lora_a
[slots, S * R, in]`` and ``lora_b [out, slots, R]`` in the layer's dtype
and device (``paged_ref.lora_ops``' layout; ``R`` = ``max_lora_rank``,
``S`` = the projections it stacks). One table per projection, not one per
model: a slot loads with one copy per projection, and a pipeline stage
holds only its layers' tables. Each projection then adds
``lora_weights.apply`` to its output when the forward pass is given a
``LoRAMapping``; without one it runs exactly as before.

Where an adapter's ``A [r, in]`` and ``B [out, r]`` go follows the layer's
own ``checkpoint_tensors`` (the seam the loader reads): a column-parallel
layer holds each stacked projection's rows of ``B`` (this rank's heads or
features) and the whole ``A``; a row-parallel one this rank's columns of
``A`` and the whole ``B``, so its partial delta joins the partial product
before the all-reduce sums both (no extra communication, as vLLM). The
scaling is folded into ``B`` in float32 before the cast.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

from paged_ref import lora_ops as ref_lora_ops
from paged_ref.lora_ops import LoRAMapping
from paged_server.models.errors import LoRAAdapterError
from paged_server.models.linear import ColumnParallelLinear, Part, RowParallelLinear

Projection = ColumnParallelLinear | RowParallelLinear  # what takes adapters


@dataclass(frozen=True, slots=True)
class Source:
    """One checkpoint projection a LoRA table reads: its model name (e.g.
    ``model.layers.0.self_attn.k_proj``), the stacked slice ``index`` it
    fills, and which part of it this rank holds (``linear.Part``)."""

    module: str
    index: int
    part: Part


class LoRAWeights:
    """One projection's slot table, what fills it, and the op applying it."""

    def __init__(
        self,
        layer: Projection,
        sources: list[Source],
        slots: int,
        rank: int,
        ops: ModuleType,
    ) -> None:
        if isinstance(layer, ColumnParallelLinear):
            self.slice_sizes = tuple(s.size for s in layer.slices)
        else:
            self.slice_sizes = (layer.out_features,)
        stacked = len(self.slice_sizes)
        dtype, device = layer.weight.dtype, layer.weight.device
        self.lora_a = torch.zeros(slots, stacked * rank, layer.in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(layer.out_features, slots, rank, dtype=dtype, device=device)
        self.sources, self.rank, self.ops = sources, rank, ops
        self.compiled_index = -1  # its number for a compiled forward's LoRA op (-1: none)

    def apply(self, x: Tensor, out: Tensor, mapping: LoRAMapping | Any) -> None:
        """Add every row's delta to the layer's output ``out`` in place.
        ``mapping``: the step's ``LoRAMapping``, or a compiled forward's
        stand-in for it (``engine/worker/compiled_forward.py``), which adds the
        delta through an op the compiler does not look into."""
        if isinstance(mapping, LoRAMapping):
            self.ops.add_lora(x, out, self.lora_a, self.lora_b, self.slice_sizes, mapping)
        else:
            mapping.add(self, x, out)

    def clear(self, slot: int) -> None:
        """Zero ``slot`` (a slot with no adapter adds exact zeros)."""
        self.lora_a[slot].zero_()
        self.lora_b[:, slot].zero_()

    def write(self, slot: int, factors: list[tuple[Source, Tensor, Tensor]]) -> None:
        """Put this rank's part of an adapter in ``slot``: per source it
        adapts, ``A [r, in]`` and ``B [out, r]`` with the scaling already
        in ``B`` (float32); sources it leaves out stay zero."""
        self.clear(slot)
        for src, a, b in factors:
            r, p = a.shape[0], src.part
            if p.dim == 0:  # a stacked projection's rows of B; A whole
                at = src.index * self.rank
                self.lora_a[slot, at : at + r].copy_(a)
                rows = b[p.start : p.start + p.size]
                self.lora_b[p.offset : p.offset + p.size, slot, :r].copy_(rows)
            else:  # this rank's columns of A; B whole
                self.lora_a[slot, :r].copy_(a[:, p.start : p.start + p.size])
                self.lora_b[:, slot, :r].copy_(b)

    def check(self, src: Source, a: Tensor, b: Tensor, where: str) -> None:
        """Raise unless ``A``/``B`` have the shapes of ``src``'s projection
        (the whole checkpoint tensor's, as the adapter stores them) and fit
        the table's rank."""
        if a.shape[0] > self.rank:
            raise LoRAAdapterError(
                f"{where} has rank {a.shape[0]} on {src.module} but max_lora_rank is {self.rank}; "
                f"start the server with --max-lora-rank {a.shape[0]} or more"
            )
        p = src.part
        in_full = self.lora_a.shape[2] if p.dim == 0 else p.full
        out_full = p.full if p.dim == 0 else self.lora_b.shape[0]
        if (a.shape[1], b.shape[0]) != (in_full, out_full):
            raise LoRAAdapterError(
                f"{where}: {src.module} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, but the model's projection maps {in_full} features to "
                f"{out_full}; the adapter was trained for another model"
            )


def projection_sources(model: nn.Module) -> dict[str, tuple[Projection, list[Source]]]:
    """Every LoRA-capable projection of ``model`` (its module name) with the
    checkpoint projections it reads, from its ``checkpoint_tensors``."""
    out = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, Projection):
            continue
        parent, _, own = prefix.rpartition(".")
        sources, index = [], 0
        for name, part in module.checkpoint_tensors(own):
            if part.param != "weight":
                continue
            full = f"{parent}.{name}" if parent else name
            sources.append(Source(full.removesuffix(".weight"), index, part))
            index += 1
        out[prefix] = (module, sources)
    return out


def attach(
    model: nn.Module, slots: int, rank: int, ops: ModuleType | None = None
) -> dict[str, LoRAWeights]:
    """Give each projection of ``model`` a zeroed ``LoRAWeights`` of
    ``slots`` slots and rank ``rank``, applied with ``ops`` (an ops module
    with ``add_lora``; default ``paged_ref.lora_ops``). Returns them by
    module name."""
    from paged_server.models.quantization.linear import QuantizedLinear

    if any(isinstance(m, QuantizedLinear) for m in model.modules()):
        raise LoRAAdapterError(
            "LoRA adapters on quantized weights are not supported yet; serve the unquantized "
            "checkpoint to use adapters"
        )
    ops = ops or ref_lora_ops
    out = {}
    for name, (layer, sources) in projection_sources(model).items():
        layer.lora_weights = out[name] = LoRAWeights(layer, sources, slots, rank, ops)
    return out


def detach(model: nn.Module) -> None:
    """Drop every projection's ``LoRAWeights`` (the forward pass is the base model's again)."""
    for module in model.modules():
        if isinstance(module, Projection):
            module.lora_weights = None

