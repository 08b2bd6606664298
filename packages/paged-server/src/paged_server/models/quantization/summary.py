"""What the loaded weights are and how many bytes they take (the start-up line)."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from paged_server.models.quantization.linear import QuantizedLinear
from paged_server.models.quantization.methods import Quantization


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters and buffers take (tied tensors once)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def dense_elements(model: nn.Module) -> int:
    """Weight elements of the model as if dense (a quantized layer counts
    ``in x out``), tied tensors once: the 16-bit comparison's numerator."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += module.in_features * module.out_features
            tensors = [] if module.bias is None else [module.bias]
        else:
            tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        for t in tensors:
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.numel()
    return total


def linear_formats(model: nn.Module) -> dict[str, int]:
    """How many layers run each quantized format, and with which kernel."""
    counts: dict[str, int] = defaultdict(int)
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            counts[f"{module.format} ({module.kernel})"] += 1
    return dict(counts)


def weights_summary(model: nn.Module, dtype: torch.dtype, quant: Quantization | None) -> str:
    """``weights: int4 g128 (online), 84 layers int4 g128 (int4pack_mm), rest
    float32: 64.0 MB (16-bit: 200.0 MB, 3.1x smaller)``."""
    size = weight_bytes(model)
    dtype_name = str(dtype).removeprefix("torch.")
    if quant is None:
        return f"weights: {dtype_name}: {size / 1e6:.1f} MB"
    layers = ", ".join(f"{n} layers {fmt}" for fmt, n in linear_formats(model).items())
    sixteen = 2 * dense_elements(model)
    return (
        f"weights: {quant.description}; {layers}; rest {dtype_name}: {size / 1e6:.1f} MB "
        f"(16-bit: {sixteen / 1e6:.1f} MB, {sixteen / size:.2f}x smaller)"
    )
