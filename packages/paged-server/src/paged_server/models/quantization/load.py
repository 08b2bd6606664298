"""Put quantized weights into a model's linear layers, by layer name.

``load_quantized_layers`` runs before the dense loader: it reads the
quantized layers' tensors from the checkpoint, slices them for this
tensor-parallel rank, and swaps each ``nn.Linear`` for a
``QuantizedLinear`` (the layer's bias stays a parameter the dense loader
fills). ``quantize_layers`` quantizes an already loaded model (online).
The LM head and embeddings stay in the model dtype, as in vLLM.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import Tensor, nn

from paged_server.models.base import CausalLM
from paged_server.models.errors import CheckpointMismatchError
from paged_server.models.quantization.linear import QuantizedLinear
from paged_server.models.quantization.methods import READERS, Quantization
from paged_server.models.quantization.weights import (
    QuantizedWeight,
    cat_rows,
    quantize_fp8,
    quantize_int,
)
from paged_server.models.registry import Architecture
from paged_server.models.tensor_parallel import SINGLE

ONLINE_INT4_GROUP = 128


def quantizable_linears(model: CausalLM) -> dict[str, nn.Linear]:
    """Every linear layer but the LM head, by module name."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name != "lm_head"
    }


def load_quantized_layers(
    model: CausalLM, arch: Architecture, files: list[Path], quant: Quantization
) -> tuple[set[str], int]:
    """Swap in the checkpoint's quantized layers; returns the checkpoint keys
    consumed (the dense loader skips them) and the bytes read."""
    reader = READERS[quant.name]
    linears = quantizable_linears(model)
    targets = _checkpoint_layers(linears)
    located: dict[str, dict[str, tuple[Path, str]]] = defaultdict(dict)
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                prefix, _, suffix = key.rpartition(".")
                name = arch.weight_name(f"{prefix}.weight")
                layer = name.removesuffix(".weight") if name else None
                if layer in targets and suffix in reader.SUFFIXES:
                    located[layer][suffix] = (file, key)
    consumed: set[str] = set()
    bytes_read = 0
    weights: dict[str, QuantizedWeight] = {}
    for layer, where in located.items():
        if not reader.is_quantized(set(where)):
            continue  # a layer the format left dense (its ignore list)
        tensors = {}
        for suffix, (file, key) in where.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                tensors[suffix] = f.get_tensor(key)
            bytes_read += tensors[suffix].numel() * tensors[suffix].element_size()
            consumed.add(key)
        if quant.name == "compressed-tensors":
            weights[layer] = reader.read_weight(tensors, layer)
        else:
            weights[layer] = reader.read_weight(tensors, layer, quant.config)
    if not weights and linears:  # served dense under a quantized name otherwise
        raise CheckpointMismatchError(
            f"config.json's quantization_config says {quant.name}, but the checkpoint has no "
            f"quantized layers (no {' / '.join(reader.SUFFIXES)} tensors beside its weights); "
            "remove quantization_config for dense weights, or point --model at the quantized ones"
        )
    swap_quantized(model, weights)
    return consumed, bytes_read


def quantizable_layers(model: CausalLM) -> set[str]:
    """The checkpoint layer names (``model.layers.0.self_attn.q_proj``) whose
    weights a quantized format may fill: every projection but the LM head."""
    return set(_checkpoint_layers(quantizable_linears(model)))


def swap_quantized(
    model: CausalLM, weights: dict[str, QuantizedWeight], partial_ok: bool = False
) -> set[str]:
    """Put ``weights`` (checkpoint layer name, e.g. ``model.layers.0.self_attn.q_proj``
    -> weight) into the model's linear layers; returns the layers put in. A
    layer that stacks projections needs all of them quantized alike: else an
    error, or with ``partial_ok`` its parts are left out (loaded dense instead)."""
    linears = quantizable_linears(model)
    targets = _checkpoint_layers(linears)
    parts: dict[str, list[tuple[Any, QuantizedWeight]]] = defaultdict(list)
    for layer, weight in weights.items():
        if layer in targets:
            module, part = targets[layer]
            parts[module].append((part, weight))
    swapped: set[str] = set()
    for module, found in parts.items():
        parent = module.rpartition(".")[0]
        slices = getattr(linears[module], "slices", None)
        if slices is None or len(slices) == 1 and found[0][0] is None:
            _swap(model, module, linears[module], found[0][1], full=True)
            swapped.add(module)
            continue
        # Projections stored apart, run stacked (fused q/k/v, gate/up): each
        # part cut to this rank's rows, then stacked in the layer's order. A
        # checkpoint that stores them stacked (Phi-3) names one tensor in
        # every slice, and each slice cuts its rows out of it.
        by_name = {part.name: weight for part, weight in found}
        missing = [s.name for s in slices if s.name not in by_name]
        mixed = len({(w.bits, w.group_size) for w in by_name.values()}) > 1
        if partial_ok and (missing or mixed):
            continue
        if missing:
            raise CheckpointMismatchError(
                f"{module}: the checkpoint quantizes some of the projections stacked here "
                f"but not {', '.join(missing)}; mixed dense and quantized parts are not supported"
            )
        stacked = cat_rows([by_name[s.name].shard(0, s.start, s.size) for s in slices])
        _swap(model, module, linears[module], stacked, full=False)
        swapped.update(f"{parent}.{s.name}" if parent else s.name for s in slices)
    return swapped


def _checkpoint_layers(linears: dict[str, nn.Linear]) -> dict[str, tuple[str, Any]]:
    """Checkpoint layer name -> (our module, the stacked slice it fills, or
    None): a layer that stacks projections (``slices``, each named as in
    the checkpoint) is filled from several checkpoint layers."""
    out: dict[str, tuple[str, Any]] = {}
    for name, linear in linears.items():
        slices = getattr(linear, "slices", None)
        if not slices or len(slices) == 1:
            out[name] = (name, None)
            continue
        parent = name.rpartition(".")[0]
        for s in slices:
            out[f"{parent}.{s.name}" if parent else s.name] = (name, s)
    return out


def quantize_layers(model: CausalLM, quant: Quantization) -> None:
    """Online quantization of the loaded (this rank's) linear weights."""
    for name, linear in quantizable_linears(model).items():
        _swap(model, name, linear, quantize_online(linear.weight, quant.name), full=False)


def quantize_online(w: Tensor, method: str) -> QuantizedWeight:
    """``--quantization method`` (fp8, int8, int4) of a 16/32-bit weight at
    load: fp8 with one scale per tensor, int8 per channel, int4 in groups of
    ``ONLINE_INT4_GROUP`` (per channel when they do not divide its inputs)."""
    if method == "fp8":
        return quantize_fp8(w)
    if method == "int8":
        return quantize_int(w, 8, None)
    k = w.shape[1]
    return quantize_int(w, 4, ONLINE_INT4_GROUP if k % ONLINE_INT4_GROUP == 0 else None)


def _swap(
    model: CausalLM, name: str, linear: nn.Linear, weight: QuantizedWeight, full: bool
) -> None:
    """Replace ``linear`` by a ``QuantizedLinear``; a ``full`` checkpoint
    weight is first cut to the slice this rank holds. Row-parallel layers
    (the ones with a ``tp`` to all-reduce over) stay row-parallel."""
    row_tp = getattr(linear, "tp", None)
    shard = None
    if row_tp is not None and hasattr(linear, "shard_start"):
        shard = (1, linear.shard_start, linear.full_size)
    elif getattr(linear, "shard_dim", None) == 0:
        shard = (0, linear.shard_start, linear.full_size)
    if shard is not None and full and model.tp.world_size > 1:
        weight = weight.shard(shard[0], shard[1], linear.weight.shape[shard[0]])
    if weight.shape != tuple(linear.weight.shape):
        raise CheckpointMismatchError(
            f"quantized weight {name} has shape {weight.shape} at {weight.bits} bits but "
            f"config.json implies {tuple(linear.weight.shape)}; the weights do not belong to "
            "this config, or quantization_config's bits are not the checkpoint's"
        )
    bias = None if linear.bias is None else linear.bias.data
    device = linear.weight.device
    module = QuantizedLinear(weight, bias, device, shard=shard, tp=row_tp or SINGLE)
    module.slices = getattr(linear, "slices", None)  # stacked projections: split() cuts them
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
