"""``cpu_gemv``: the one-row int4/int8 kernels against aten's packed kernels
on the same buffers, and against the exact float product of the dequantized
weight (both round only their bf16 output, so they agree within a bf16 step
of the output's scale). Skipped where the kernels cannot be built (no C
compiler, no AVX512-BF16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from paged_server.models.quantization import QuantizedLinear, QuantizedWeight, cpu_gemv

pytestmark = pytest.mark.skipif(
    not cpu_gemv.available(), reason="cpu_gemv needs a C compiler and AVX512-BF16"
)

CPU = torch.device("cpu")


def _weight(n: int, k: int, bits: int, group: int, asym: bool, seed: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1)
    q = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
    zeros = torch.randint(lo, hi, (n, k // group), generator=g, dtype=torch.int8) if asym else None
    return QuantizedWeight(q, scales, zeros, bits, group)


def _row(k: int, seed: int) -> torch.Tensor:
    return torch.randn(1, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within one bf16 step (2^-8 relative) of the output's largest value:
    the float32 sums differ only in order."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()


@pytest.mark.parametrize(
    ("n", "k", "group", "asym"),
    [(64, 256, 32, False), (128, 256, 64, True), (192, 512, 128, True), (1280, 768, 256, False)],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_int4_matches_aten_and_the_dequantized_product(
    n: int, k: int, group: int, asym: bool, threads: int
) -> None:
    w = _weight(n, k, 4, group, asym, seed=n + k)
    layer = QuantizedLinear(w, None, CPU)
    assert layer.kernel == "int4pack_mm" and layer.one_row
    x = _row(k, seed=k)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_gemv.int4_gemv(x, layer.qweight, layer.scales, layer.group_size)
    finally:
        torch.set_num_threads(before)
    aten = torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.qweight, layer.group_size, layer.scales)
    _close(got, aten)
    _close(got, F.linear(x.float(), w.dequantize()).to(torch.bfloat16))


@pytest.mark.parametrize(("n", "k"), [(64, 256), (100, 768), (7, 32)])  # rows past a multiple of 8
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_matches_aten_and_the_dequantized_product(n: int, k: int, threads: int) -> None:
    w = _weight(n, k, 8, k, False, seed=n + k)
    layer = QuantizedLinear(w, None, CPU)
    assert layer.kernel == "int8pack_mm" and layer.one_row
    x = _row(k, seed=k)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_gemv.int8_gemv(x, layer.qweight, layer.scales)
    finally:
        torch.set_num_threads(before)
    _close(got, torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.scales))
    # the scale is rounded to bf16 as aten's kernel takes it
    exact = F.linear(x.float(), w.qweight.float()) * layer.scales.float()
    _close(got, exact.to(torch.bfloat16))


def test_layers_the_kernels_cannot_take_keep_aten() -> None:
    """int4 outputs not a multiple of 64 columns (aten's last block is laid
    out differently) and int8 inputs not a multiple of 16 stay on aten."""
    assert not QuantizedLinear(_weight(96, 256, 4, 128, False, 0), None, CPU).one_row
    assert not QuantizedLinear(_weight(64, 40, 8, 40, False, 0), None, CPU).one_row


@pytest.mark.parametrize("bits", [4, 8])
def test_one_row_layers_call_the_kernel_eager_and_compiled(bits: int) -> None:
    """A single row runs the kernel (in a compiled graph: an opaque op call),
    more rows run aten's, and both compute the same product."""
    w = _weight(128, 256, bits, 128 if bits == 4 else 256, bits == 4, seed=3)
    layer = QuantizedLinear(w, torch.randn(128), CPU)
    x = _row(256, seed=5)
    eager = layer(x)
    layer.one_row = False
    _close(eager, layer(x))
    layer.one_row = True
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    with torch.no_grad():
        out, code = run_and_get_code(compiled, x)
    assert f"paged.int{bits}_gemv" in "\n".join(code)
    _close(out, eager)
    rows = torch.randn(3, 256).to(torch.bfloat16)
    with torch.no_grad():
        out, code = run_and_get_code(compiled, rows)
    assert "gemv" not in "\n".join(code)
    _close(out, layer(rows))
