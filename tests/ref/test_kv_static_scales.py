"""Static KV scales (``calculate_kv_scales``): the round trip with one scale
per kv head, saturation beyond the calibrated range, and pools that keep no
per-token scales (an int8 pool is exactly half a 16-bit one)."""

from __future__ import annotations

import pytest
import torch

from paged_ref import ContiguousKVPool, PagedKVPool, ops
from paged_ref.kv_quant import (
    FP8_MAX,
    HEAD_SCALE_EPS,
    dequantize,
    head_scales_from_absmax,
    kv_bytes_per_token,
    quantize,
    quantize_static,
)
from paged_ref.kv_spec import KVCacheSpec

HEAD_DIM = 16
DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
# Relative rounding error of a normal fp8 number (half an ulp).
FP8_REL = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}


def _calibrated(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scales that map each head's absmax over ``x`` ([tokens, heads, dim]) to qmax."""
    return head_scales_from_absmax(x.abs().amax(dim=(0, 2)), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["int8", "fp8_e4m3", "fp8_e5m2"])
def test_round_trip_within_calibrated_range(dtype, gen):
    # Two heads three decades apart: each gets its own scale, so the small head keeps precision.
    x = torch.randn(32, 2, HEAD_DIM, generator=gen) * torch.tensor([1e-2, 10.0]).view(1, 2, 1)
    scales = _calibrated(x, dtype)
    assert scales.dtype == torch.float32 and scales.shape == (2,)
    assert scales[1] / scales[0] == pytest.approx(
        float(x[:, 1].abs().max() / x[:, 0].abs().max()), rel=1e-5
    )
    codes = quantize_static(x, dtype, scales)
    assert codes.dtype == dtype
    back = dequantize(codes, None, head_scales=scales)
    if dtype == torch.int8:
        bound = scales.view(1, 2, 1) / 2 * 1.0001  # half a step of each head
    else:  # relative rounding; a value mapped below the normal range is a tiny share of absmax
        bound = FP8_REL[dtype] * x.abs() + scales.view(1, 2, 1) * 2.0**-9
    assert ((back - x).abs() <= bound).all()
    # The head's absmax uses the format's whole range: it comes back (nearly) exactly.
    torch.testing.assert_close(back.abs().amax(dim=(0, 2)), x.abs().amax(dim=(0, 2)), rtol=1e-3, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["int8", "fp8_e4m3", "fp8_e5m2"])
def test_values_beyond_the_calibrated_range_saturate(dtype):
    scales = torch.tensor([0.5, 2.0])
    qmax = 127.0 if dtype == torch.int8 else FP8_MAX[dtype]
    x = torch.zeros(1, 2, HEAD_DIM)
    x[0, :, 0] = 1e9  # far beyond qmax * scale
    x[0, :, 1] = -1e9
    x[0, :, 2] = float("inf")
    back = dequantize(quantize_static(x, dtype, scales), None, head_scales=scales)
    assert torch.isfinite(back).all()
    assert back[0, :, 0].tolist() == pytest.approx((qmax * scales).tolist())
    assert back[0, :, 1].tolist() == pytest.approx((-qmax * scales).tolist())
    assert back[0, :, 2].tolist() == pytest.approx((qmax * scales).tolist())
    assert (back[0, :, 3:] == 0).all()


def test_calibrated_fp8_keeps_small_values_that_scale_one_loses(gen):
    """With vLLM's scale of 1.0, K/V of magnitude ~1e-3 fall into e4m3's
    subnormals (coarse steps of 2^-9); a calibrated scale keeps them normal."""
    x = torch.randn(64, 1, HEAD_DIM, generator=gen) * 1e-3
    dtype = torch.float8_e4m3fn
    err_one = (dequantize(quantize(x, dtype)[0], None) - x).abs().max()
    scales = _calibrated(x, dtype)
    err_static = (dequantize(quantize_static(x, dtype, scales), None, head_scales=scales) - x).abs().max()
    assert err_static < err_one / 5  # ~1e-4 vs ~1e-3


def test_an_all_zero_head_gets_the_floor_scale_and_stores_zeros():
    x = torch.zeros(4, 2, HEAD_DIM)
    x[:, 1] = 1.0
    scales = _calibrated(x, torch.int8)
    assert scales[0] == pytest.approx(HEAD_SCALE_EPS) and scales[0] > 0
    back = dequantize(quantize_static(x, torch.int8, scales), None, head_scales=scales)
    assert torch.equal(back[:, 0], torch.zeros(4, HEAD_DIM))


@pytest.mark.parametrize("pool_kind", ["paged", "contiguous"])
def test_int8_pool_with_static_scales_is_exactly_half_a_16_bit_pool(pool_kind):
    layers, kv_heads = 3, 2

    def pool(kv_cache_dtype, kv_scales=None):
        if pool_kind == "paged":
            return PagedKVPool.from_model_config(
                layers, kv_heads, 64, 10, 16, torch.bfloat16, "meta",
                kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales,
            )  # fmt: skip
        return ContiguousKVPool.from_model_config(
            layers, kv_heads, 64, 32, 5, dtype=torch.bfloat16, device="meta",
            kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales,
        )  # fmt: skip

    ones = torch.ones(layers, kv_heads)
    static = pool("int8", (ones, ones))
    assert static.k_scales is None and static.v_scales is None
    assert static.k_head_scales is not None and static.k_head_scales.shape == (layers, kv_heads)
    assert 2 * static.kv_bytes() == pool("auto").kv_bytes()
    assert pool("int8").kv_bytes() > static.kv_bytes()  # per-token scales cost bytes
    assert kv_bytes_per_token(layers, kv_heads, 64, torch.int8, static_scales=True) * 2 == (
        kv_bytes_per_token(layers, kv_heads, 64, torch.bfloat16)
    )
    bf16 = KVCacheSpec.dense(layers, kv_heads, 64, torch.bfloat16)
    budget = 40 * bf16.block_bytes()
    assert bf16.blocks_in(budget) == 40
    static_int8 = KVCacheSpec.dense(layers, kv_heads, 64, torch.bfloat16, kv_cache_dtype="int8", static_scales=True)
    assert static_int8.blocks_in(budget) == 80


def test_write_kv_with_head_scales_stores_value_over_scale(gen):
    ones = torch.ones(2, 2)
    k_scales, v_scales = ones * 0.01, ones * 0.02
    pool = PagedKVPool.from_model_config(
        2, 2, HEAD_DIM, num_blocks=4, block_size=4, dtype=torch.float32, kv_cache_dtype="int8",
        kv_scales=(k_scales, v_scales),
    )  # fmt: skip
    k, v = torch.randn(3, 2, HEAD_DIM, generator=gen), torch.randn(3, 2, HEAD_DIM, generator=gen)
    layer = 1
    heads = {"k_head_scales": pool.k_head_scales[layer], "v_head_scales": pool.v_head_scales[layer]}
    ops.write_kv(pool.k_cache[layer], pool.v_cache[layer], k, v, torch.tensor([5, -1, 9]), **heads)
    assert torch.equal(pool.k_cache[layer, 1, 1], quantize_static(k[0], torch.int8, k_scales[layer]))
    assert torch.equal(pool.v_cache[layer, 2, 1], quantize_static(v[2], torch.int8, v_scales[layer]))
    assert (pool.k_cache[0] == 0).all()  # another layer untouched


def test_bad_static_scales_are_clear_errors():
    cache = torch.zeros(2, 4, 2, HEAD_DIM, dtype=torch.int8)
    new = torch.ones(1, 2, HEAD_DIM)
    with pytest.raises(ValueError, match=r"k_head_scales must be \[2\] torch.float32"):
        ops.write_kv(cache, cache.clone(), new, new, torch.tensor([0]),
                     k_head_scales=torch.ones(3), v_head_scales=torch.ones(2))  # fmt: skip
    fp32 = torch.zeros(2, 4, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="static scales apply to int8 and fp8"):
        ops.write_kv(fp32, fp32.clone(), new, new, torch.tensor([0]),
                     k_head_scales=torch.ones(2), v_head_scales=torch.ones(2))  # fmt: skip
    with pytest.raises(ValueError, match=r"static k scales must be \[layers, kv_heads\] = \[1, 2\]"):
        PagedKVPool.from_model_config(1, 2, HEAD_DIM, 4, 4, torch.float32, kv_cache_dtype="int8",
                                      kv_scales=(torch.ones(2), torch.ones(1, 2)))  # fmt: skip
