"""bf16 projections of 1 to ``FEW_ROWS`` rows on a CPU with AVX512-BF16
(``few_row_gemm.c``): one stream's decode, a speculative verify step, a
draft model's passes, a few streams' decode.

``linear.attach_few_row_weights`` gives every dense bf16 projection of a
model (the stacked column-parallel and row-parallel layers, the LM head) a
copy of its weight in the kernel's layout, ``few_row_weight``, with
``pack``; ``linear`` then runs a product
of at most ``FEW_ROWS`` rows on it (in eager mode and inside the compiled
graphs, where the row count is static) and any other through ``F.linear``.
The copy costs the weights' bytes once more; the compiled few-row graphs
no longer hold oneDNN's or inductor's own packed copies of them.

Speed (2-core EPYC with AVX512-BF16, no AMX, one thread; docs/cpu.md has
the steps): a 256 x 256 product at 5 rows 4 us against oneDNN's ~20, the
embedded model's 4,096 x 256 LM head at 1 row 24 against 62. A row's result
does not depend on how many rows share the call (each output sums its
products in input order). Where the library cannot be built (no compiler,
no AVX512-BF16) ``available()`` is False and nothing is attached; nor on a
CPU with AMX tiles (``preferred``).

The kernel is a torch operator (``paged::few_row_gemm``) registered through
``torch.library.Library``: the compiled graph calls it as an opaque op.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FEW_ROWS = 8  # the kernel's most rows (the compiled pass's ROW_BUCKET)

_build_lock = threading.Lock()  # engines loading on two threads register the operator once
_kernels: Any = None  # the loaded library, once built


@functools.cache
def _build() -> Any | None:
    global _kernels
    if not torch.cpu._is_avx512_bf16_supported():
        return None
    # imported here, as cpu_gemv does: a worker may import this module before its start-up guard
    from paged_ref.cpu import c_library

    lib = c_library.build(c_library.source("few_row_gemm.c"), (), "few_row_gemm", "few_row_gemm")
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.few_row_pack.argtypes = [p, p, i64, i64]
    lib.few_row_gemm.argtypes = [p, i64, p, p, i64, i64, i64, ctypes.c_int]
    lib.few_row_pack.restype = lib.few_row_gemm.restype = None
    _kernels = lib
    _register()
    return lib


def available() -> bool:
    """Whether the kernel runs here (built on the first call)."""
    with _build_lock:
        return _build() is not None


def preferred() -> bool:
    """Whether a model's weights are packed on this CPU: the kernel built, and no
    AMX tiles (measured only without them; an AMX CPU keeps inductor's GEMM
    template, which its measurements chose at 1-8 rows)."""
    from paged_server.platform import cpu_has_amx

    return available() and not cpu_has_amx()


def applies(weight: Tensor) -> bool:
    """Whether ``weight`` (``[out, in]``) can take the kernel: bf16 on a CPU,
    an even number of input features."""
    return weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.shape[1] % 2 == 0


def pack(weight: Tensor) -> Tensor:
    """``weight`` in the kernel's layout: blocks of 16 outputs (zero-padded),
    each input feature pair's 16 x 2 weights side by side (``few_row_gemm.c``)."""
    if not available():
        raise RuntimeError("few_row_gemm is not available here (no C compiler or no AVX512-BF16)")
    n, k = weight.shape
    w = weight.detach().contiguous()
    out = w.new_empty(-(-n // 16) * 16 * k)
    _kernels.few_row_pack(w.data_ptr(), out.data_ptr(), n, k)
    return out


def linear(layer: nn.Linear, x: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, layer.weight, bias)``, through the kernel where
    ``few_rows`` applies."""
    out = few_rows(layer, x)
    if out is None:
        return F.linear(x, layer.weight, bias)
    return out if bias is None else out + bias


def few_rows(layer: nn.Module, x: Tensor) -> Tensor | None:
    """``x`` times ``layer``'s weight (no bias) through the kernel, where
    ``layer`` has a packed weight (``few_row_weight``) and ``x`` is 1 to
    ``FEW_ROWS`` bf16 rows of a static count (a dynamic graph's symbolic
    count keeps aten's product); else None."""
    packed: Tensor | None = getattr(layer, "few_row_weight", None)
    rows = x.shape[0]
    if packed is None or x.dim() != 2 or type(rows) is not int or not 0 < rows <= FEW_ROWS or x.dtype != packed.dtype:
        return None
    return torch.ops.paged.few_row_gemm(x, packed, layer.weight.shape[0])  # type: ignore[no-any-return]


def _gemm_cpu(x: Tensor, packed: Tensor, n: int) -> Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    out = x.new_empty(rows, n)
    _kernels.few_row_gemm(
        x.data_ptr(), x.stride(0), packed.data_ptr(), out.data_ptr(), rows, n, k, torch.get_num_threads()
    )
    return out


_lib: torch.library.Library | None = None


def _register() -> None:
    """The operator: its CPU kernel and a shape-only one (what Dynamo traces with)."""
    global _lib
    _lib = torch.library.Library("paged", "FRAGMENT")
    _lib.define("few_row_gemm(Tensor x, Tensor packed, int n) -> Tensor")
    _lib.impl("few_row_gemm", _gemm_cpu, "CPU")
    _lib.impl("few_row_gemm", lambda x, packed, n: x.new_empty(x.shape[0], n), "Meta")
