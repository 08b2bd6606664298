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

from safetensors import safe_open
from torch import nn

from paged_server.models.base import CausalLM
from paged_server.models.errors import CheckpointMismatchError
from paged_server.models.quantization.linear import QuantizedLinear
from paged_server.models.quantization.methods import READERS, Quantization
from paged_server.models.quantization.weights import QuantizedWeight, quantize_fp8, quantize_int
from paged_server.models.registry import Architecture

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
    located: dict[str, dict[str, tuple[Path, str]]] = defaultdict(dict)
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                prefix, _, suffix = key.rpartition(".")
                name = arch.weight_name(f"{prefix}.weight")
                module = name.removesuffix(".weight") if name else None
                if module in linears and suffix in reader.SUFFIXES:
                    located[module][suffix] = (file, key)
    consumed: set[str] = set()
    bytes_read = 0
    for module, where in located.items():
        if not reader.is_quantized(set(where)):
            continue  # a layer the format left dense (its ignore list)
        tensors = {}
        for suffix, (file, key) in where.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                tensors[suffix] = f.get_tensor(key)
            bytes_read += tensors[suffix].numel() * tensors[suffix].element_size()
            consumed.add(key)
        if quant.name == "compressed-tensors":
            weight = reader.read_weight(tensors, module)
        else:
            weight = reader.read_weight(tensors, module, quant.config)
        _swap(model, module, linears[module], weight, full=True)
    return consumed, bytes_read


def quantize_layers(model: CausalLM, quant: Quantization) -> None:
    """Online quantization of the loaded (this rank's) linear weights."""
    for name, linear in quantizable_linears(model).items():
        w = linear.weight
        if quant.name == "fp8":
            weight = quantize_fp8(w)
        elif quant.name == "int8":
            weight = quantize_int(w, 8, None)
        else:
            k = w.shape[1]
            weight = quantize_int(w, 4, ONLINE_INT4_GROUP if k % ONLINE_INT4_GROUP == 0 else None)
        _swap(model, name, linear, weight, full=False)


def _swap(
    model: CausalLM, name: str, linear: nn.Linear, weight: QuantizedWeight, full: bool
) -> None:
    """Replace ``linear`` by a ``QuantizedLinear``; a ``full`` checkpoint
    weight is first cut to the slice this rank holds."""
    shard = None
    dim = getattr(linear, "shard_dim", None)
    if dim is not None:
        shard = (dim, linear.shard_start, linear.full_size)
        if full and model.tp.world_size > 1:
            size = linear.weight.shape[dim]
            weight = weight.shard(dim, linear.shard_start, size)
    if weight.shape != tuple(linear.weight.shape):
        raise CheckpointMismatchError(
            f"quantized weight {name} has shape {weight.shape} but config.json implies "
            f"{tuple(linear.weight.shape)}; the weights do not belong to this config"
        )
    bias = None if linear.bias is None else linear.bias.data
    device = linear.weight.device
    module = QuantizedLinear(weight, bias, device, shard=shard, tp=getattr(linear, "tp", model.tp))
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
