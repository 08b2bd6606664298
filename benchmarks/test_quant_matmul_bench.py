"""Weight-only quantized GEMM on a GPU: ``paged_triton.quant_matmul``
against what the CUDA path did before it (dequantize the weight, then a
16-bit matmul) and against the 16-bit matmul alone, side by side.

Llama 3.1 8B's o_proj (4096 x 4096) and fused gate/up (28672 x 4096)
projections, bf16 activations, M = 1 (decode) to 2048 (prefill) rows, for
int8 per output channel, int4 in groups of 128, and int4 with zero points
(AWQ / W4A16 asym). Each case builds a real ``QuantizedLinear`` on the GPU
(so the layer's own dispatch runs) and times three things with
``triton.testing.do_bench`` (L2 flushed before each timed call):
``triton`` (the layer), ``dequantize`` (its dense weight rebuilt per call,
then ``F.linear``) and ``bf16`` (``F.linear`` on the dense weight).
``extra_info`` holds all three, the ratios, and the weight bytes read per
second by the kernel (decode is bound by them: int4 reads a quarter of
bf16's bytes).

Needs CUDA (``nox -s gpu`` runs it); skipped elsewhere.
Run: ``pytest benchmarks/test_quant_matmul_bench.py --benchmark-only -p no:randomly``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CUDA, reason="GPU benchmark: needs CUDA (nox -s gpu)"),
]

SHAPES = {"o 4096x4096": (4096, 4096), "gate_up 28672x4096": (28672, 4096)}
ROWS = (1, 16, 64, 512, 2048)
# name -> (bits, group size (None: per output channel), zero points)
FORMATS = {"int8 per-channel": (8, None, False), "int4 g128": (4, 128, False),
           "int4 g128 asym": (4, 128, True)}  # fmt: skip


def _layer(n: int, k: int, bits: int, group: int | None, asym: bool):
    from paged_server.models.quantization.linear import QuantizedLinear
    from paged_server.models.quantization.weights import QuantizedWeight, quantize_int

    gen = torch.Generator(device="cuda").manual_seed(0)
    dense = torch.randn(n, k, generator=gen, device="cuda") * 0.02
    w = quantize_int(dense, bits, group)
    if asym:
        zeros = torch.randint(-2, 3, w.scales.shape, generator=gen, device="cuda", dtype=torch.int8)
        w = QuantizedWeight(w.qweight, w.scales, zeros, bits, w.group_size)
    layer = QuantizedLinear(w, None, torch.device("cuda"))
    assert layer.kernel == "quant_matmul", layer.kernel
    return layer


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quant_matmul(benchmark, fmt, shape, m):
    import triton.testing

    from paged_triton import kernel_bench

    n, k = SHAPES[shape]
    bits, group, asym = FORMATS[fmt]
    layer = _layer(n, k, bits, group, asym)
    dense = layer.dequantized_weight(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got, want = layer(x), F.linear(x, dense)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)

    def ms(fn) -> float:
        return float(triton.testing.do_bench(fn, warmup=25, rep=100))

    triton_ms = ms(lambda: layer(x))
    dequantize_ms = ms(lambda: F.linear(x, layer.dequantized_weight(torch.bfloat16)))
    bf16_ms = ms(lambda: F.linear(x, dense))
    weight_bytes = sum(t.numel() * t.element_size() for t in (layer.qweight, layer.scales))
    if layer.zeros is not None:
        weight_bytes += layer.zeros.numel()
    gbps = weight_bytes / (triton_ms * 1e-3) / 1e9
    peak = kernel_bench.peak_bandwidth(x.device)
    benchmark.group = "quant matmul"
    benchmark.extra_info.update(
        case=f"{fmt} {shape} M={m}",
        impl="triton",
        device=torch.cuda.get_device_name(),
        dtype="bfloat16",
        m=m,
        n=n,
        k=k,
        kernel_ms=triton_ms,
        dequantize_ms=dequantize_ms,
        bf16_ms=bf16_ms,
        speedup_vs_dequantize=dequantize_ms / triton_ms,
        speedup_vs_bf16=bf16_ms / triton_ms,
        weight_bytes=weight_bytes,
        GBps=gbps,
        pct_of_peak=None if peak is None else 100 * gbps * 1e9 / peak,
        TFLOPs=2 * m * n * k / (triton_ms * 1e-3) / 1e12,
        timing="do_bench, L2 flushed",
    )

    def call() -> None:
        layer(x)
        torch.cuda.synchronize()

    benchmark.pedantic(call, rounds=10, warmup_rounds=1)
