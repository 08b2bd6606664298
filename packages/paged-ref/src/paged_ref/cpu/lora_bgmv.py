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

    @property
    def args(self) -> tuple[int, ...]:
        """The kernel's last four arguments."""
        return (self.rows.data_ptr(), self.row_slots.data_ptr(), self.chunks.data_ptr(), self.num_chunks)


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
def _kernel(dtype: torch.dtype, flags: tuple[str, ...] = ()) -> Any:
    """The built ``lora_bgmv`` for activations of ``dtype`` (``flags``: more
    compiler flags, for the tests), or None."""
    c_type, *defines = _C_TYPES[dtype]
    lib = c_library.build(
        SOURCE, (*_FLAGS, f"-Dact_t={c_type}", *defines, *flags), "lora_bgmv", f"bgmv-{str(dtype)[6:]}"
    )
    if lib is None:
        return None
    fn = lib.lora_bgmv
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i64, p, i64, p, p, i64, i64, i64, i64, p, p, p, p, i64]
    fn.restype = ctypes.c_int
    return fn


def pairs(dtype: torch.dtype) -> bool:
    """Whether the kernel for ``dtype`` reads ``pair_table``'s layout of
    ``lora_b`` (bf16, in pairs of rank columns) rather than lora_ops' expand matrix."""
    return dtype == torch.bfloat16


def pair_table(lora_b: Tensor) -> Tensor:
    """``lora_b [out, slots, R]`` as ``[slots, R / 2, out, 2]``: each output
    column's two neighbouring rank columns side by side, what a bf16 pair
    product reads (R even)."""
    out_features, slots, rank = lora_b.shape
    return lora_b.view(out_features, slots, rank // 2, 2).permute(1, 2, 0, 3).contiguous()


class Table(NamedTuple):
    """A projection's slot table as the kernel reads it, prepared once per
    version of its ``lora_b`` (lora_ops keeps it): the kernel for its dtype,
    the tensors it points into (held, so the pointers stay valid) and the
    kernel's table arguments."""

    kernel: Any
    tensors: tuple[Tensor, ...]
    args: tuple[int, ...]


def prepare(lora_a: Tensor, table: Tensor, slice_sizes: tuple[int, ...]) -> Table | None:
    """The ``Table`` for ``lora_a [slots, S * R, in]`` and ``table``: for
    bf16 (``pairs``) ``pair_table(lora_b)``, else lora_ops' expand matrix
    ``[slots * S * R, out]``. None where the kernel does not apply: not a
    CPU, another dtype, tables not contiguous, an odd rank in bf16, or no
    build."""
    dtype = lora_a.dtype
    if lora_a.device.type != "cpu" or dtype not in _C_TYPES or table.dtype != dtype:
        return None
    rank = lora_a.shape[1] // len(slice_sizes)
    if not (lora_a.is_contiguous() and table.is_contiguous()) or (pairs(dtype) and rank % 2):
        return None
    kernel = _kernel(dtype)
    if kernel is None:
        return None
    offsets = torch.tensor(np.cumsum([0, *slice_sizes]), dtype=torch.int64)
    args = (
        lora_a.data_ptr(), table.data_ptr(), lora_a.shape[2], sum(slice_sizes), len(slice_sizes), rank,
        offsets.data_ptr(),
    )  # fmt: skip
    return Table(kernel, (lora_a, table, offsets), args)


def add_rows(x: Tensor, out: Tensor, t: Table, p: Plan) -> bool:
    """Add the planned rows' deltas to ``out [rows, out]`` in place from
    ``x [rows, in]`` and the prepared table ``t``; False (nothing added)
    where the kernel does not apply: ``x``/``out`` of another dtype or
    device, or a row of ``out`` not contiguous."""
    dtype = t.tensors[0].dtype
    if x.dtype != dtype or out.dtype != dtype or out.stride(1) != 1 or x.device.type != "cpu":
        return False
    if x.stride(1) != 1:
        x = x.contiguous()
    if p.num_chunks == 0:  # no row uses an adapter
        return True
    if t.kernel(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), *t.args, *p.args):
        raise MemoryError("lora_bgmv could not allocate its scratch rows")
    return True
