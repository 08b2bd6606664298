"""The weight-only quantized GEMM (``paged_triton.quant_matmul``) against
dequantize-then-matmul in PyTorch, on the layout ``QuantizedLinear`` keeps
for it: int8 and int4 (two codes per byte), per output channel and in
groups of 128 input features, symmetric and with zero points, decode-,
batch- and prefill-sized M (1, 5, 33: each tile bucket's masking), N not a
multiple of the tile, split-K.

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

from paged_triton.quant_matmul import block_k_for, quant_matmul, split_k, supports, tile_for


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


def _reference(x, q, scales, zeros, group):
    """Dequantize in float32, round to x's dtype (what the kernel multiplies),
    then a float32 matmul rounded once to x's dtype."""
    w = q.float()
    if zeros is not None:
        w = w - zeros.float().repeat_interleave(group, dim=1)
    w = (w * scales.repeat_interleave(group, dim=1)).to(x.dtype)
    return F.linear(x.float(), w.float()).to(x.dtype)


def _check(paged, m, n, k, bits, group, asym, dtype, splits=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, scales, zeros = _weight(n, k, bits, group, asym, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    expected = _reference(x, q, scales, zeros, group)
    dev = paged.device
    got = quant_matmul(
        x.to(dev), _pack(q, bits).to(dev), scales.to(dev),
        None if zeros is None else zeros.to(dev), bits, group, splits=splits,
    )  # fmt: skip
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
    got = quant_matmul(x.to(dev), layer.qweight.to(dev), layer.scales.to(dev), zeros,
                       layer.bits, layer.group_size)  # fmt: skip
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
