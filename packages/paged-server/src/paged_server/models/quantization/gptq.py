"""GPTQ checkpoints (AutoGPTQ / GPTQModel, ``quant_method: gptq``).

Per layer: ``qweight`` int32 ``[K / pack, N]`` (values packed along the
input features, low bits first), ``qzeros`` int32 ``[groups, N / pack]``
(packed along the output features; format ``gptq`` stores zero - 1,
``gptq_v2`` the zero itself), ``scales [groups, N]`` and ``g_idx [K]``
(each input feature's group). ``w[n, k] = (q - zero[g_idx[k]]) * scale[g_idx[k]]``.
Act-order checkpoints (``desc_act``) whose ``g_idx`` is not the plain
``k // group_size`` are refused for now.
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

SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
FORMATS = ("gptq", "gptq_v2")  # checkpoint_format: zeros stored minus 1, or as they are


def config_int(qc: dict[str, Any], method: str, field: str, default: int, hint: str = "") -> int:
    """``quantization_config[field]``, refused unless it is an integer."""
    value = qc.get(field, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidConfigError(
            f"{method} quantization_config.{field} must be a number{hint}, got {value!r}"
        )
    return value


def check_config(qc: dict[str, Any]) -> str:
    bits = config_int(qc, "GPTQ", "bits", 4, " (4 or 8)")
    if bits not in (4, 8):
        raise InvalidConfigError(f"GPTQ with {bits} bits is not supported; 4 and 8 are")
    group_size = config_int(qc, "GPTQ", "group_size", 128)
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in FORMATS:
        raise InvalidConfigError(
            f"GPTQ checkpoint_format {fmt!r} is not supported; {' and '.join(FORMATS)} are "
            "(marlin checkpoints hold Marlin's repacked layout: load the GPTQ checkpoint it "
            "was converted from)"
        )
    return f"gptq int{bits} g{group_size}"


def is_quantized(suffixes: set[str]) -> bool:
    return "qweight" in suffixes


def unpack(
    packed: torch.Tensor, bits: int, dim: int, order: list[int] | None = None
) -> torch.Tensor:
    """Unsigned values from int32 words packed along ``dim`` (value ``i`` of
    a word at bits ``bits * i``, or at ``bits * order.index(i)`` with an order)."""
    per_word = 32 // bits
    words = packed.to(torch.int32)
    words = words.transpose(0, 1) if dim == 0 else words
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    if order is not None:  # position of column c inside the word
        shifts = shifts[torch.tensor([order.index(c) for c in range(per_word)])]
    values = ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(1)
    return values.transpose(0, 1).contiguous() if dim == 0 else values


def read_weight(t: dict[str, torch.Tensor], name: str, qc: dict[str, Any]) -> QuantizedWeight:
    require(t, name, "GPTQ", "qweight", "qzeros", "scales")
    bits = int(qc.get("bits", 4))
    offset = 1 << (bits - 1)
    q = unpack(t["qweight"], bits, dim=0)  # [K, N]
    k, n = q.shape
    g_idx = t.get("g_idx")
    if g_idx is not None and g_idx.numel() != k:
        raise CheckpointMismatchError(
            f"{name}.qweight unpacks to {k} input features at bits {bits} (quantization_config) "
            f"but {name}.g_idx has {g_idx.numel()}; the config's bits are not the checkpoint's"
        )
    scales = finite_scales(t["scales"], f"{name}.scales")  # [groups, N]
    if scales.ndim != 2 or scales.shape[1] != n:
        raise CheckpointMismatchError(
            f"{name}.scales has shape {tuple(scales.shape)}, but {name}.qweight holds {n} "
            f"output features (groups x {n} expected)"
        )
    groups = scales.shape[0]
    group_size = group_size_of(f"{name}.scales", groups, k)
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group_size):
        raise InvalidConfigError(
            f"{name}: act-order GPTQ (desc_act with a permuted g_idx) is not supported yet; "
            "use a checkpoint quantized with desc_act=False"
        )
    zeros = unpack(t["qzeros"], bits, dim=1)[:, :n]  # [groups, N]
    if zeros.shape != (groups, n):
        raise CheckpointMismatchError(
            f"{name}.qzeros unpacks to {tuple(zeros.shape)} zero points, but {name}.scales "
            f"has {(groups, n)}"
        )
    if qc.get("checkpoint_format", "gptq") == "gptq":
        zeros = zeros + 1  # gptq v1 stores zero - 1
    sym = bool(qc.get("sym", True)) and bool(torch.all(zeros == offset))
    return QuantizedWeight(
        (q - offset).to(torch.int8).T.contiguous(),
        scales.T.contiguous(),
        None if sym else (zeros - offset).to(torch.int8).T.contiguous(),
        bits,
        group_size,
    )
