"""compressed-tensors checkpoints (vLLM's format, written by llmcompressor).

config.json's ``quantization_config`` has ``quant_method:
compressed-tensors`` and a ``format`` (global, or per config group):
- ``pack-quantized``: int4/int8 values packed into int32 along the input
  features (``weight_packed``, 32/bits per word, low bits first, stored with
  an offset of ``2**(bits-1)``), ``weight_scale [N, groups]``,
  ``weight_shape``, and ``weight_zero_point`` packed along the output rows
  when asymmetric (W4A16, W8A16).
- ``naive-quantized``: int8 ``weight`` with ``weight_scale`` (and zero point).
- ``float-quantized``: float8_e4m3fn ``weight`` with ``weight_scale`` per
  tensor or per channel (FP8, FP8_DYNAMIC). A static ``input_scale`` is
  ignored: activations stay in the compute dtype (weight-only arithmetic).

Which layers are quantized is read from the tensors (a layer with a
``weight_scale`` or ``weight_packed``), so the config's targets and ignore
list need no regex matching here; the bits and group size come from the
shapes.
"""

from __future__ import annotations

from typing import Any

import torch

from paged_server.models.errors import CheckpointMismatchError, InvalidConfigError
from paged_server.models.quantization.weights import (
    QuantizedWeight,
    finite_scales,
    group_size_of,
    require,
)

SUFFIXES = (
    "weight",
    "weight_packed",
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
    "input_scale",
)
FORMATS = ("pack-quantized", "naive-quantized", "float-quantized", "int-quantized")


def check_config(qc: dict[str, Any]) -> str:
    """Refuse formats and schemes this loader cannot run; returns a short
    description for the start-up line."""
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not all(
        isinstance(g, dict) and isinstance(g.get("weights") or {}, dict) for g in groups.values()
    ):
        raise InvalidConfigError(
            "compressed-tensors quantization_config.config_groups must map group names to "
            f"objects (each with a weights object), got {groups!r:.80}"
        )
    formats = {qc.get("format")} | {g.get("format") for g in groups.values()}
    formats.discard(None)
    formats.discard("mixed-precision")
    unknown = formats - set(FORMATS)
    if unknown:
        raise InvalidConfigError(
            f"compressed-tensors format {sorted(unknown)} is not supported; supported: "
            f"{', '.join(FORMATS)} (int4/int8 weights, fp8 weights)"
        )
    for name, group in groups.items():
        w = group.get("weights") or {}
        if w.get("type") == "float" and w.get("num_bits") != 8:
            raise InvalidConfigError(
                f"compressed-tensors group {name}: only 8-bit float weights are supported"
            )
        if w.get("strategy") == "block":
            raise InvalidConfigError(
                f"compressed-tensors group {name}: block-wise weight scales are not supported yet"
            )
    if qc.get("sparsity_config"):
        raise InvalidConfigError("compressed-tensors sparse checkpoints are not supported")
    return "compressed-tensors " + "/".join(sorted(formats))


def is_quantized(suffixes: set[str]) -> bool:
    return "weight_packed" in suffixes or "weight_scale" in suffixes


def read_weight(t: dict[str, torch.Tensor], name: str) -> QuantizedWeight:
    """One layer's tensors (keyed by suffix) -> ``QuantizedWeight``."""
    if "weight_packed" in t:
        fmt = "compressed-tensors pack-quantized"
        require(t, name, fmt, "weight_packed", "weight_scale", "weight_shape")
        if t["weight_shape"].numel() != 2:
            raise CheckpointMismatchError(
                f"{name}.weight_shape is {t['weight_shape'].tolist()}; it should hold the "
                "layer's [output features, input features]"
            )
        n, k = (int(x) for x in t["weight_shape"].tolist())
        packed = t["weight_packed"]
        bits = 32 * packed.shape[1] // k if k else 0
        if bits not in (4, 8) or packed.shape != (n, k * bits // 32):
            raise CheckpointMismatchError(
                f"{name}.weight_packed has shape {tuple(packed.shape)}, which packs neither 4 nor "
                f"8 bits for weight_shape {(n, k)}"
            )
        q = unpack_int32(packed, bits, dim=1)[:, :k]
        zeros = t.get("weight_zero_point")
        if zeros is not None:
            zeros = unpack_int32(zeros, bits, dim=0)[:n]  # packed along the output rows
    else:
        require(t, name, "compressed-tensors", "weight", "weight_scale")
        q = t["weight"]
        if q.dtype not in (torch.int8, torch.float8_e4m3fn):
            raise CheckpointMismatchError(
                f"{name}.weight has dtype {q.dtype} beside a weight_scale; expected int8 or "
                "float8_e4m3fn"
            )
        bits = 8
        zeros = t.get("weight_zero_point")
        if zeros is not None and not torch.any(zeros):
            zeros = None
    n, k = q.shape
    scale = finite_scales(t["weight_scale"], f"{name}.weight_scale")
    if scale.numel() == 1:  # one scale for the tensor
        scale = scale.reshape(1, 1).expand(n, 1)
    elif scale.numel() % n:
        raise CheckpointMismatchError(
            f"{name}.weight_scale has {scale.numel()} values, not a whole number per each of "
            f"the weight's {n} output features"
        )
    else:
        scale = scale.reshape(n, scale.numel() // n)
    group_size = group_size_of(f"{name}.weight_scale", scale.shape[1], k)
    if zeros is not None:
        if zeros.numel() != scale.numel():
            raise CheckpointMismatchError(
                f"{name}.weight_zero_point holds {zeros.numel()} zero points for "
                f"{scale.numel()} scales"
            )
        zeros = zeros.reshape(scale.shape).to(torch.int8)
    fp8 = q.dtype == torch.float8_e4m3fn
    return QuantizedWeight(q, scale.contiguous(), zeros, bits, group_size, fp8=fp8)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Signed int8 values from int32 words packed along ``dim`` (low bits
    first, each value stored plus ``2**(bits-1)``), as compressed-tensors packs."""
    per_word = 32 // bits
    words = packed.transpose(0, 1) if dim == 0 else packed
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    values = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = values.flatten(1) - (1 << (bits - 1))
    out = values.to(torch.int8)
    return out.transpose(0, 1).contiguous() if dim == 0 else out
