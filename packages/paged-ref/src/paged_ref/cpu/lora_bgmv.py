"""LoRA deltas of a step's decode rows as one C loop per projection (BGMV).

``lora_ops.add_lora``'s decode rows otherwise shrink against every slot
of the table (masked): on a CPU that costs ``--max-loras`` times the
adapters' work, and at the embedded model's width it cost more than the
base projections. ``lora_bgmv.c`` reads each row's own slot in place,
rows of one slot in chunks that share each loaded row of A and B.

``plan`` groups a step's decode rows once (every projection of every layer
reuses it); ``add_rows`` runs the kernel. It is built on first use
(``c_library``), once per activation dtype, into ``~/.cache/paged/lora_bgmv``;
where it cannot be built, ``add_rows`` returns False and the caller keeps
its torch path.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from paged_ref.cpu import c_library

SOURCE = c_library.source("lora_bgmv.c")
GROUP = 4  # lora_bgmv.c's: the most rows of one slot in a chunk
_C_TYPES = {torch.bfloat16: ("uint16_t", "-DACT_BF16"), torch.float16: ("_Float16",), torch.float32: ("float",)}
# Beside c_library.FLAGS: the dot products vectorize only reassociated, and
# GCC's x86 default is 256-bit vectors even where the CPU has AVX-512.
_FLAGS = ("-ffast-math", "-fno-finite-math-only") + (
    ("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ()
)


class Plan(NamedTuple):
    """One step's decode rows grouped by slot: ``rows`` (int32, base rows
    left out) sorted by slot, each one's slot, and ``chunks`` (int32
    ``[num_chunks + 1]``): where each run of at most ``GROUP`` rows of one
    slot starts in ``rows``."""

    rows: Tensor
    row_slots: Tensor
    chunks: Tensor
    num_chunks: int


def plan(token_slots: Tensor) -> Plan:
    """The grouping of rows with slots ``token_slots`` (-1: base, left out)."""
    slots = token_slots.cpu().numpy()
    rows = np.flatnonzero(slots >= 0)
    rows = rows[np.argsort(slots[rows], kind="stable")].astype(np.int32)
    row_slots = slots[rows].astype(np.int32)
    at = np.arange(len(rows))
    first = np.ones(len(rows), dtype=bool)  # the first row of each slot's run
    first[1:] = row_slots[1:] != row_slots[:-1]
    run_start = np.maximum.accumulate(np.where(first, at, 0))
    chunks = np.flatnonzero(first | ((at - run_start) % GROUP == 0)).astype(np.int32)
    chunks = np.append(chunks, np.int32(len(rows)))
    return Plan(torch.from_numpy(rows), torch.from_numpy(row_slots), torch.from_numpy(chunks), len(chunks) - 1)


@functools.cache
def _kernel(dtype: torch.dtype) -> Any:
    """The built ``lora_bgmv`` for activations of ``dtype``, or None."""
    c_type, *defines = _C_TYPES[dtype]
    lib = c_library.build(SOURCE, (*_FLAGS, f"-Dact_t={c_type}", *defines), "lora_bgmv", f"bgmv-{str(dtype)[6:]}")
    if lib is None:
        return None
    fn = lib.lora_bgmv
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i64, p, i64, p, p, i64, i64, i64, i64, p, p, p, p, i64]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _offsets(slice_sizes: tuple[int, ...]) -> Tensor:
    """Each stacked projection's first output column, and the end (int64)."""
    return torch.tensor(np.cumsum([0, *slice_sizes]), dtype=torch.int64)


def add_rows(x: Tensor, out: Tensor, lora_a: Tensor, expand: Tensor, slice_sizes: tuple[int, ...], p: Plan) -> bool:
    """Add the planned rows' deltas to ``out [rows, out]`` in place, from
    ``x [rows, in]``, ``lora_a [slots, S * R, in]`` and ``expand [slots * S
    * R, out]``; False (nothing added) where the kernel does not apply: not
    a CPU, another dtype, a row of ``out`` or a table not contiguous, or no
    build."""
    kernel = _kernel(x.dtype) if x.device.type == "cpu" and x.dtype in _C_TYPES else None
    if (
        kernel is None or out.dtype != x.dtype or out.stride(1) != 1 or lora_a.dtype != x.dtype
        or expand.dtype != x.dtype or not (lora_a.is_contiguous() and expand.is_contiguous())
    ):  # fmt: skip
        return False
    if x.stride(1) != 1:
        x = x.contiguous()
    if p.num_chunks == 0:  # no row uses an adapter
        return True
    slots, stacked, in_features = lora_a.shape
    offsets = _offsets(slice_sizes)
    status = kernel(
        x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), lora_a.data_ptr(),
        expand.data_ptr(), in_features, out.shape[1], len(slice_sizes), stacked // len(slice_sizes),
        offsets.data_ptr(), p.rows.data_ptr(), p.row_slots.data_ptr(), p.chunks.data_ptr(), p.num_chunks,
    )  # fmt: skip
    if status:
        raise MemoryError("lora_bgmv could not allocate its scratch rows")
    return True
