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
from paged_server.models.quantization.gptq import unpack
from paged_server.models.quantization.weights import QuantizedWeight

SUFFIXES = ("qweight", "qzeros", "scales")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def check_config(qc: dict[str, Any]) -> str:
    bits = qc.get("bits", qc.get("w_bit", 4))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise InvalidConfigError(
            f"AWQ {version} with {bits} bits is not supported; 4-bit GEMM checkpoints are"
        )
    return f"awq int4 g{qc.get('group_size', qc.get('q_group_size', 128))}"


def is_quantized(suffixes: set[str]) -> bool:
    return "qweight" in suffixes


def read_weight(t: dict[str, torch.Tensor], name: str, qc: dict[str, Any]) -> QuantizedWeight:
    q = unpack(t["qweight"], 4, dim=1, order=AWQ_ORDER)  # [K, N]
    zeros = unpack(t["qzeros"], 4, dim=1, order=AWQ_ORDER)  # [groups, N]
    scales = t["scales"].to(torch.float32)
    k, n = q.shape
    groups = scales.shape[0]
    if scales.shape != (groups, n) or zeros.shape != (groups, n) or k % groups:
        raise CheckpointMismatchError(
            f"{name}: AWQ scales {tuple(scales.shape)} / qzeros {tuple(zeros.shape)} do not fit "
            f"qweight of {k} x {n}"
        )
    if not qc.get("zero_point", True):
        zeros = torch.full_like(zeros, 8)
    return QuantizedWeight(
        (q - 8).to(torch.int8).T.contiguous(),
        scales.T.contiguous(),
        (zeros - 8).to(torch.int8).T.contiguous(),
        4,
        k // groups,
    )
