"""AWQ checkpoints (AutoAWQ GEMM layout, ``quant_method: awq``).

Per layer: ``qweight`` int32 ``[K, N / 8]`` and ``qzeros`` int32
``[groups, N / 8]``, both packed along the output features in AWQ's
interleaved order (word nibble ``i`` holds column ``[0, 2, 4, 6, 1, 3, 5,
7][i]``), and ``scales [groups, N]``. ``w[n, k] = (q - zero) * scale`` with
unsigned 4-bit values and zeros (asymmetric, ``zero_point: true``).
"""

from __future__ import annotations

from typing import Any

import torch

from paged_server.models.errors import CheckpointMismatchError, InvalidConfigError
from paged_server.models.quantization.gptq import config_int, unpack
from paged_server.models.quantization.weights import (
    QuantizedWeight,
    finite_scales,
    group_size_of,
    require,
)

SUFFIXES = ("qweight", "qzeros", "scales")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def check_config(qc: dict[str, Any]) -> str:
    # AutoAWQ's own names (w_bit, q_group_size) where vLLM's are absent
    bits = config_int(qc, "AWQ", "bits" if "bits" in qc else "w_bit", 4, " (4)")
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise InvalidConfigError(
            f"AWQ {version} with {bits} bits is not supported; 4-bit GEMM checkpoints are"
        )
    group_size = config_int(qc, "AWQ", "group_size" if "group_size" in qc else "q_group_size", 128)
    return f"awq int4 g{group_size}"


def is_quantized(suffixes: set[str]) -> bool:
    return "qweight" in suffixes


def read_weight(t: dict[str, torch.Tensor], name: str, qc: dict[str, Any]) -> QuantizedWeight:
    require(t, name, "AWQ", "qweight", "qzeros", "scales")
    q = unpack(t["qweight"], 4, dim=1, order=AWQ_ORDER)  # [K, N]
    zeros = unpack(t["qzeros"], 4, dim=1, order=AWQ_ORDER)  # [groups, N]
    scales = finite_scales(t["scales"], f"{name}.scales")
    k, n = q.shape
    if scales.ndim != 2 or scales.shape[1] != n:
        raise CheckpointMismatchError(
            f"{name}.scales has shape {tuple(scales.shape)}, but {name}.qweight holds {n} "
            f"output features (groups x {n} expected)"
        )
    group_size = group_size_of(f"{name}.scales", scales.shape[0], k)
    if zeros.shape != scales.shape:
        raise CheckpointMismatchError(
            f"{name}.qzeros unpacks to {tuple(zeros.shape)} zero points, but {name}.scales "
            f"has {tuple(scales.shape)}"
        )
    if not qc.get("zero_point", True):
        zeros = torch.full_like(zeros, 8)
    return QuantizedWeight(
        (q - 8).to(torch.int8).T.contiguous(),
        scales.T.contiguous(),
        (zeros - 8).to(torch.int8).T.contiguous(),
        4,
        group_size,
    )
