"""One-row int4/int8 products on a CPU with AVX512 VNNI (``cpu_gemv.c``).

A single stream's decode step multiplies one row of activations by every
weight. Inductor's C++ GEMM template (what the compiled forward runs for
int4/int8) dequantizes to bf16 and is compute-bound at one row, below the
bf16 product's bytes per second. These kernels quantize the row to int8 per
block of input features and multiply with int8 dot products, as vLLM's CPU
path for AWQ/GPTQ does (IPEX, lowp_mode INT8); ``benchmarks/quantized_gemm.py``
times them, docs/models.md has the numbers. The activation rounding
costs ~1% of a product's largest value (tests/server/models/test_cpu_gemv.py
states it exactly); more rows (prefill, batches) keep bf16 activations.

The kernels are torch operators (``paged::int4_gemv``, ``paged::int8_gemv``)
registered through ``torch.library.Library``, which the compiled graph calls
as opaque ops more cheaply than a ``custom_op``. They read the
buffers QuantizedLinear keeps for aten's kernels (no second copy). The
library is built on first use (``paged_ref.cpu.c_library``, where the C source lives); where it cannot be
(no compiler, no AVX512 VNNI/VBMI, aten packing int4 for another vector
width) ``available()`` is False and QuantizedLinear keeps aten's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any

import torch
from torch import Tensor

INT4_BLOCK = 64  # output columns per block of aten's AVX512 int4 layout
INT8_BLOCK = 128  # cpu_gemv.c's: input features per activation scale of an int8 product


_build_lock = threading.Lock()  # engines loading on two threads register the operators once
_kernels: Any = None  # the loaded library, once built


def _library() -> Any | None:
    with _build_lock:
        return _build()


@functools.cache
def _build() -> Any | None:
    global _kernels
    if torch.backends.cpu.get_cpu_capability() != "AVX512":  # aten's int4 layout is per vector width
        return None
    # imported here: a tensor-parallel worker imports this module before its
    # start-up guard runs, and must report a broken paged_ref from inside it
    from paged_ref.cpu import c_library

    lib = c_library.build(c_library.source("cpu_gemv.c"), (), "cpu_gemv", "gemv")
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.int4_gemv.argtypes = [p, p, p, p, i64, i64, i64, ctypes.c_int]
    lib.int8_gemv.argtypes = [p, p, p, p, i64, i64, ctypes.c_int]
    lib.int4_gemv.restype = lib.int8_gemv.restype = None
    _kernels = lib
    _register()
    return lib


def available() -> bool:
    """Whether the kernels run here (built on the first call)."""
    return _library() is not None


def int4_applies(out_features: int, in_features: int, group_size: int) -> bool:
    return (
        available()
        and out_features % INT4_BLOCK == 0
        and in_features % group_size == 0
        and group_size % 4 == 0
    )


def int8_applies(in_features: int) -> bool:
    return available() and in_features % INT8_BLOCK == 0


def int4_gemv(x: Tensor, packed: Tensor, scales_zeros: Tensor, group_size: int) -> Tensor:
    """``aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_zeros)``
    for one bf16 row ``x`` (``[1, K]``), the row quantized to int8 per group
    (``quantize_row``); check ``int4_applies`` first."""
    return torch.ops.paged.int4_gemv(x, packed, scales_zeros, group_size)  # type: ignore[no-any-return]


def int8_gemv(x: Tensor, qweight: Tensor, scales: Tensor) -> Tensor:
    """``aten._weight_int8pack_mm(x, qweight, scales)`` for one bf16 row ``x``,
    quantized to int8 per ``INT8_BLOCK`` input features."""
    return torch.ops.paged.int8_gemv(x, qweight, scales)  # type: ignore[no-any-return]


def quantize_row(x: Tensor, block: int) -> Tensor:
    """The activations the kernels multiply by: ``x`` rounded to int8 steps
    of ``absmax / 127`` per ``block`` features (ties to even), in float32."""
    blocks = x.float().reshape(*x.shape[:-1], -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = (blocks * inv).round().clamp(-127, 127)
    return (q * (amax / 127.0)).reshape(x.shape)


def _int4_cpu(x: Tensor, packed: Tensor, scales_zeros: Tensor, group_size: int) -> Tensor:
    x = x.contiguous()
    n, k = scales_zeros.shape[1], x.shape[-1]
    out = x.new_empty(1, n)
    _kernels.int4_gemv(
        x.data_ptr(), packed.data_ptr(), scales_zeros.data_ptr(), out.data_ptr(), n, k, group_size,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def _int8_cpu(x: Tensor, qweight: Tensor, scales: Tensor) -> Tensor:
    x = x.contiguous()
    n, k = qweight.shape
    out = x.new_empty(1, n)
    _kernels.int8_gemv(
        x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), out.data_ptr(), n, k,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


_lib: torch.library.Library | None = None


def _register() -> None:
    """The two operators, a CPU kernel and a shape-only one each (what
    Dynamo traces with)."""
    global _lib
    _lib = torch.library.Library("paged", "FRAGMENT")
    _lib.define("int4_gemv(Tensor x, Tensor packed, Tensor scales_zeros, int group_size) -> Tensor")
    _lib.define("int8_gemv(Tensor x, Tensor qweight, Tensor scales) -> Tensor")
    _lib.impl("int4_gemv", _int4_cpu, "CPU")
    _lib.impl("int8_gemv", _int8_cpu, "CPU")
    _lib.impl("int4_gemv", lambda x, p, sz, g: x.new_empty(1, sz.shape[1]), "Meta")
    _lib.impl("int8_gemv", lambda x, q, s: x.new_empty(1, q.shape[0]), "Meta")
