"""The weight-only quantized GEMM (``paged_triton.quant_matmul``) against
dequantize-then-matmul in PyTorch, on the layout ``QuantizedLinear`` keeps
for it: int8 and int4 (two codes per byte), per output channel and in
groups of 128 input features, symmetric and with zero points, decode-,
batch- and prefill-sized M (1, 5, 33: each tile bucket's masking), N not a
multiple of the tile, split-K; and the prefill path (``quant_dequantize``,
the dense weight in one pass, then cuBLAS) with the row count that picks it.

Tolerance: both sides dequantize the same codes the same way ((code -
zero) * scale in float32, rounded once to the activations' dtype) and
accumulate exact products in float32; only the summation order differs,
then both round once to the dtype. So the conftest's per-dtype bounds hold
(float16 3e-3, bfloat16 3e-2, float32 2e-5 on outputs of size ~1): a
wrong nibble, zero or group shifts an output by ~0.1 or more.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged_triton.quant_dequantize import dequantize
from paged_triton.quant_matmul import (
    DENSE_ROWS,
    QuantWeight,
    block_k_for,
    prefers_dense,
    quant_matmul,
    split_k,
    supports,
    tile_for,
)


def _weight(n, k, bits, group, asym, gen):
    """Codes, float32 scales and int8 zeros (or None) of a random weight whose
    dequantized values are ~N(0, 1/k), so outputs are ~N(0, 1)."""
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    q = torch.randint(lo, hi + 1, (n, k), generator=gen, dtype=torch.int8)
    groups = k // group
    scales = (torch.rand(n, groups, generator=gen) + 0.5) * (2.0 / (hi * k**0.5))
    zeros = None
    if asym:
        zeros = torch.randint(lo // 2, hi // 2 + 1, (n, groups), generator=gen, dtype=torch.int8)
    return q, scales, zeros


def _pack(q, bits):
    """The stored form: int8 as is; int4 two to a byte, (code + 8), even feature low."""
    if bits == 8:
        return q
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def _dense(q, scales, zeros, group, dtype):
    """Dequantized in float32, rounded once to ``dtype`` (what the kernel multiplies)."""
    w = q.float()
    if zeros is not None:
        w = w - zeros.float().repeat_interleave(group, dim=1)
    return (w * scales.repeat_interleave(group, dim=1)[:, : w.shape[1]]).to(dtype)


def _reference(x, q, scales, zeros, group):
    """The dense weight in x's dtype, then a float32 matmul rounded once to x's dtype."""
    w = _dense(q, scales, zeros, group, x.dtype)
    return F.linear(x.float(), w.float()).to(x.dtype)


def _check(paged, m, n, k, bits, group, asym, dtype, splits=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, scales, zeros = _weight(n, k, bits, group, asym, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    expected = _reference(x, q, scales, zeros, group)
    dev = paged.device
    w = QuantWeight(_pack(q, bits).to(dev), scales.to(dev), None if zeros is None else zeros.to(dev), bits, group)
    got = quant_matmul(x.to(dev), w, splits=splits)
    paged.assert_close(got.cpu(), expected, dtype)


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
def test_group_128_matches_dequantize_then_matmul(m, bits, asym, paged):
    _check(paged, m, 48, 256, bits, 128, asym, torch.float16, seed=m * 10 + bits)


@pytest.mark.parametrize("bits", [8, 4])
def test_per_channel_with_a_masked_k_tail(bits, paged):
    """One group spanning all 160 features: the second 128-wide K tile is
    mostly past the end (masked) and still uses the row's one scale."""
    _check(paged, 5, 40, 160, bits, 160, False, torch.float16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bits", [8, 4])
def test_other_activation_dtypes(dtype, bits, paged):
    _check(paged, 5, 48, 256, bits, 128, True, dtype)


@pytest.mark.parametrize("bits", [8, 4])
def test_split_k_partials_sum_to_the_same_result(bits, paged):
    """Four programs per output tile, each a quarter of K (two groups of
    32: a 32-wide K tile), their float32 partials summed."""
    _check(paged, 1, 48, 256, bits, 32, True, torch.float16, splits=4)


def test_small_groups_shrink_the_k_tile():
    assert tile_for(1, 128, 4096).block_k == 128
    assert tile_for(1, 32, 4096).block_k == 32
    assert tile_for(1, 4096, 4096).block_k == 128  # per-channel
    assert tile_for(200, 128, 4096).block_k == 64
    assert block_k_for(24, 4096, 128) is None
    assert "multiple of 16" in (supports(4, 24, 4096) or "")
    assert "odd" in (supports(4, 4096, 4095) or "")
    assert supports(8, 128, 4096) is None


def test_split_k_fills_the_gpu_only_for_few_output_tiles():
    decode = tile_for(1, 128, 4096)
    assert split_k(decode, 1, 4096, 4096, sms=132) > 1  # 64 output tiles for 132 SMs
    assert split_k(decode, 1, 4096, 4096, sms=None) == 1  # the interpreter
    assert split_k(decode, 1, 4096, 256, sms=132) == 1  # too short a K loop to split
    prefill = tile_for(512, 128, 4096)
    assert split_k(prefill, 512, 4096, 4096, sms=132) == 1
    # Within a bucket the split depends on N and K only, never on M.
    assert len({split_k(decode, m, 4096, 4096, 132) for m in range(1, 17)}) == 1


@pytest.mark.parametrize(
    ("bits", "group", "asym"), [(8, 160, False), (8, 32, True), (4, 128, True)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dequantize_writes_the_weight_the_kernel_multiplies(bits, group, asym, dtype, paged):
    """The prefill path's dense weight: every value exactly ``(code - zero) *
    scale`` rounded once to the dtype, for N and K (per channel: 160, a
    masked K tail) that are not multiples of the tile."""
    gen = torch.Generator().manual_seed(bits + group)
    q, scales, zeros = _weight(72, 160 if group == 160 else 256, bits, group, asym, gen)
    dev = paged.device
    w = QuantWeight(_pack(q, bits).to(dev), scales.to(dev), None if zeros is None else zeros.to(dev), bits, group)
    got = dequantize(w, dtype)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.cpu(), _dense(q, scales, zeros, group, dtype), rtol=0, atol=0)


def test_many_rows_take_the_dense_path():
    """Decode and small batches run the kernel; prefill-sized row counts
    dequantize once and let cuBLAS multiply."""
    assert not any(prefers_dense(m) for m in (1, 16, 64, DENSE_ROWS - 1))
    assert all(prefers_dense(m) for m in (DENSE_ROWS, 2048, 8192))


@pytest.mark.parametrize("rows", [3, DENSE_ROWS], ids=["kernel", "dense"])
def test_quantized_linear_on_the_kernels_path(rows, monkeypatch, paged):
    """A ``QuantizedLinear`` on the Triton path gives the same output as
    dequantize-then-matmul whichever way its row count sends it (leading
    dims flattened), and the dense way dequantizes exactly when it should."""
    from paged_server.models.quantization import linear
    from paged_server.models.quantization.weights import quantize_int
    from paged_triton import quant_dequantize

    monkeypatch.setattr(linear, "_cpu_kernels", lambda: False)
    gen = torch.Generator().manual_seed(rows)
    w = quantize_int(torch.randn(48, 256, generator=gen) * 0.1, 4, 128)
    layer = linear.QuantizedLinear(w, None, paged.device)
    layer.kernel = "quant_matmul"  # what a CUDA device picks (built here on any device)
    calls = []
    counting = _counting(quant_dequantize.dequantize, calls)
    monkeypatch.setattr(quant_dequantize, "dequantize", counting)
    x = torch.randn(1, rows, 256, generator=gen).to(paged.device, torch.bfloat16)
    got = layer(x)
    dense = layer.dequantized_weight(torch.float32).to(torch.bfloat16)  # rounded once
    expected = F.linear(x.float(), dense.float()).to(torch.bfloat16)
    assert got.shape == (1, rows, 48)
    assert len(calls) == (rows >= DENSE_ROWS)
    paged.assert_close(got.cpu(), expected.cpu(), torch.bfloat16)


def _counting(fn, calls):
    def wrapped(*args, **kwargs):
        calls.append(args)
        return fn(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize(("bits", "group", "asym"), [(8, None, False), (8, 128, True), (4, 128, True)])
def test_quantized_linear_layout_is_the_kernels(bits, group, asym, monkeypatch, paged):
    """The buffers ``QuantizedLinear`` keeps for dequantize-per-call (the
    layout its CUDA path hands this kernel) give the layer's own output."""
    from paged_server.models.quantization import linear
    from paged_server.models.quantization.weights import QuantizedWeight, quantize_int

    monkeypatch.setattr(linear, "_cpu_kernels", lambda: False)  # the layout, built on CPU
    gen = torch.Generator().manual_seed(bits)
    w = quantize_int(torch.randn(40, 256, generator=gen) * 0.1, bits, group)
    if asym:
        zeros = torch.randint(-2, 3, w.scales.shape, generator=gen, dtype=torch.int8)
        w = QuantizedWeight(w.qweight, w.scales, zeros, bits, w.group_size)
    layer = linear.QuantizedLinear(w, None, torch.device("cpu"))
    assert layer.kernel == "dequantize"
    x = torch.randn(3, 256, generator=gen).to(torch.float16)
    expected = layer(x)
    dev = paged.device
    zeros = None if layer.zeros is None else layer.zeros.to(dev)
    w = QuantWeight(layer.qweight.to(dev), layer.scales.to(dev), zeros, layer.bits, layer.group_size)
    got = quant_matmul(x.to(dev), w)
    paged.assert_close(got.cpu(), expected, torch.float16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bits", [8, 4])
def test_cuda_layer_runs_the_kernel(bits, paged):
    """On CUDA, int8/int4 ``QuantizedLinear`` layers run this kernel (bf16,
    a Llama-sized projection, split-K) and match dequantize-then-matmul."""
    from paged_server.models.quantization.linear import QuantizedLinear
    from paged_server.models.quantization.weights import quantize_int

    gen = torch.Generator().manual_seed(0)
    w = quantize_int(torch.randn(4096, 2048, generator=gen) * 0.02, bits, 128)
    layer = QuantizedLinear(w, None, torch.device("cuda"))
    assert layer.kernel == "quant_matmul"
    for m in (1, 7, 300):
        x = torch.randn(m, 2048, generator=gen).to("cuda", torch.bfloat16)
        expected = F.linear(x.float(), layer.dequantized_weight(torch.bfloat16).float())
        paged.assert_close(layer(x), expected.to(torch.bfloat16), torch.bfloat16)
