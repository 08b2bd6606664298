"""8-bit KV caches: the quantize -> dequantize round trip, and the reference
ops and pools on int8 / fp8 blocks."""

from __future__ import annotations

import pytest
import torch

from paged_ref import ContiguousKVPool, PagedKVPool, ops
from paged_ref.kv_quant import (
    FP8_MAX,
    SCALE_DTYPE,
    cache_dtype_for,
    dequantize,
    kv_bytes_per_token,
    quantize,
)

HEAD_DIM = 16
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Relative rounding error of a normal number (half an ulp: 2^-(mantissa bits + 1))
# and the absolute error of a subnormal one (half the smallest subnormal step).
FP8_REL = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}
FP8_ABS = {torch.float8_e4m3fn: 2.0**-10, torch.float8_e5m2: 2.0**-17}


def _round_trip(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    codes, scales = quantize(x, dtype)
    assert codes.dtype == dtype
    return dequantize(codes, scales), scales


def _int8_bound(x: torch.Tensor) -> torch.Tensor:
    """Half a quantization step of each token (absmax / 254), plus the float16
    rounding of the scale (relative 2^-11, times the largest code)."""
    absmax = x.abs().amax(-1, keepdim=True)
    return absmax / 254 + absmax * 2.0**-11 + 1e-12


def test_int8_round_trip_within_half_a_step(gen):
    x = torch.randn(64, 4, HEAD_DIM, generator=gen) * torch.logspace(-3, 3, 64).view(64, 1, 1)
    back, scales = _round_trip(x, torch.int8)
    assert scales is not None and scales.shape == (64, 4) and scales.dtype == SCALE_DTYPE
    assert ((back - x).abs() <= _int8_bound(x)).all()
    # Each token's largest value comes back within a step: the scale used all 127 codes.
    torch.testing.assert_close(back.abs().amax(-1), x.abs().amax(-1), rtol=1 / 127, atol=0)


def test_int8_outlier_costs_only_its_own_token(gen):
    x = torch.randn(8, 2, HEAD_DIM, generator=gen)
    x[3, 1, 5] = 1000.0  # one outlier in token 3, head 1
    back, _ = _round_trip(x, torch.int8)
    err = (back - x).abs()
    assert err[3, 1].max() <= 1000.0 / 254 * 1.01  # coarse steps, but only here
    others = torch.ones(8, 2, dtype=torch.bool)
    others[3, 1] = False
    assert (err[others] <= _int8_bound(x)[others]).all()
    assert err[others].max() < 0.02  # normal tokens keep ~1% precision
    assert back[3, 1, 5] == pytest.approx(1000.0, rel=1e-3)


@pytest.mark.parametrize("dtype", [torch.int8, *FP8])
def test_zeros_and_a_whole_zero_block_round_trip_exactly(dtype, gen):
    x = torch.randn(4, 2, HEAD_DIM, generator=gen)
    x[1] = 0.0  # a whole token (every head) of zeros
    x[2, 0, ::2] = 0.0  # scattered zeros
    back, scales = _round_trip(x, dtype)
    assert torch.isfinite(back).all()
    assert (back[1] == 0).all() and (back[2, 0, ::2] == 0).all()
    block = torch.zeros(16, 2, HEAD_DIM)  # a whole block of zeros: scale 0, no NaN
    back, scales = _round_trip(block, dtype)
    assert torch.equal(back, block)
    if scales is not None:
        assert (scales == 0).all()


def test_int8_tiny_values_underflowing_the_scale_store_zeros():
    x = torch.full((1, 1, HEAD_DIM), 1e-9)  # absmax / 127 underflows float16 to 0
    back, scales = _round_trip(x, torch.int8)
    assert scales is not None and scales.item() == 0
    assert torch.equal(back, torch.zeros_like(x))


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_round_trip_relative_error_and_saturation(dtype, gen):
    bound = FP8_MAX[dtype]
    x = torch.randn(256, HEAD_DIM, generator=gen) * torch.logspace(-6, 2, 256).view(256, 1)
    back, scales = _round_trip(x, dtype)
    assert scales is None  # per-tensor scale 1.0: nothing stored
    assert ((back - x).abs() <= FP8_REL[dtype] * x.abs() + FP8_ABS[dtype]).all()
    outliers = torch.tensor([[bound * 4, -bound * 100, bound, 1.0]])
    back, _ = _round_trip(outliers, dtype)
    assert back.tolist() == [[bound, -bound, bound, 1.0]]  # saturated, never inf or NaN


def test_kv_cache_dtype_names():
    assert cache_dtype_for("auto", torch.float16) == torch.float16
    assert cache_dtype_for("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert cache_dtype_for("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    assert cache_dtype_for("fp8_e5m2", torch.float32) == torch.float8_e5m2
    assert cache_dtype_for("int8", torch.float32) == torch.int8
    with pytest.raises(ValueError, match="auto, fp8, fp8_e4m3, fp8_e5m2, int8, int4; got 'fp4'"):
        cache_dtype_for("fp4", torch.float16)


@pytest.mark.parametrize(
    ("dtype", "ratio"),
    [(torch.float16, 1.0), (torch.float8_e4m3fn, 2.0), (torch.int8, 2 * 64 / 66)],
)
def test_bytes_per_token_count_the_scales(dtype, ratio):
    fp16 = kv_bytes_per_token(2, 4, 64, torch.float16)
    assert fp16 == 2 * 2 * 4 * 64 * 2
    assert fp16 / kv_bytes_per_token(2, 4, 64, dtype) == pytest.approx(ratio)


@pytest.mark.parametrize("dtype", ["int8", "fp8", "fp8_e5m2"])
def test_write_kv_stores_codes_and_scales(dtype, gen):
    pool = PagedKVPool.from_model_config(
        1, 2, HEAD_DIM, num_blocks=6, block_size=4, dtype=torch.float32, kv_cache_dtype=dtype
    )
    k = torch.randn(3, 2, HEAD_DIM, generator=gen)
    v = torch.randn(3, 2, HEAD_DIM, generator=gen)
    slots = torch.tensor([5 * 4 + 3, -1, 2 * 4 + 1])
    scales = {"k_scales": None, "v_scales": None}
    if pool.k_scales is not None:
        scales = {"k_scales": pool.k_scales[0], "v_scales": pool.v_scales[0]}
    ops.write_kv(pool.k_cache[0], pool.v_cache[0], k, v, slots, **scales)
    for (blk, off), i in {(5, 3): 0, (2, 1): 2}.items():
        for cache, sc, new in ((pool.k_cache, pool.k_scales, k), (pool.v_cache, pool.v_scales, v)):
            codes, want_scale = quantize(new[i], cache.dtype)
            assert torch.equal(cache[0, blk, off], codes)
            if sc is not None:
                assert torch.equal(sc[0, blk, off], want_scale)
    assert int((pool.k_cache[0].float() != 0).sum()) == 2 * 2 * HEAD_DIM - int(
        (quantize(k[[0, 2]], pool.k_cache.dtype)[0].float() == 0).sum()
    )


def test_int8_cache_without_scales_is_a_clear_error():
    cache = torch.zeros(2, 4, 1, HEAD_DIM, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8 cache needs k_scales"):
        ops.write_kv(cache, cache.clone(), torch.ones(1, 1, HEAD_DIM), torch.ones(1, 1, HEAD_DIM),
                     torch.tensor([0]))  # fmt: skip


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_quantized_decode_and_prefill_equal_attention_over_dequantized_cache(dtype, gen):
    """Attention over an 8-bit cache is exactly attention over its dequantized
    float32 copy: the ops dequantize and do nothing else differently."""
    pool = PagedKVPool.from_model_config(
        1, 2, HEAD_DIM, num_blocks=8, block_size=4, dtype=torch.float32, kv_cache_dtype=dtype
    )
    n = 11
    k, v = torch.randn(n, 2, HEAD_DIM, generator=gen), torch.randn(n, 2, HEAD_DIM, generator=gen)
    tables = torch.tensor([[6, 1, 4]], dtype=torch.int32)
    slots = torch.tensor([int(tables[0, p // 4]) * 4 + p % 4 for p in range(n)])
    kw = {}
    if pool.k_scales is not None:
        kw = {"k_scales": pool.k_scales[0], "v_scales": pool.v_scales[0]}
    ops.write_kv(pool.k_cache[0], pool.v_cache[0], k, v, slots, **kw)
    k_deq = dequantize(pool.k_cache[0], kw.get("k_scales"))
    v_deq = dequantize(pool.v_cache[0], kw.get("v_scales"))
    lens = torch.tensor([n], dtype=torch.int32)
    q = torch.randn(1, 4, HEAD_DIM, generator=gen)
    got = ops.paged_decode_attention(q, pool.k_cache[0], pool.v_cache[0], tables, lens, 0.3, **kw)
    want = ops.paged_decode_attention(q, k_deq, v_deq, tables, lens, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    qp = torch.randn(5, 4, HEAD_DIM, generator=gen)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    got = ops.paged_prefill_attention(qp, pool.k_cache[0], pool.v_cache[0], tables, cu, lens, 0.3,
                                      **kw)  # fmt: skip
    want = ops.paged_prefill_attention(qp, k_deq, v_deq, tables, cu, lens, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_copy_blocks_copies_int8_scales(gen):
    pool = PagedKVPool.from_model_config(
        2, 2, HEAD_DIM, num_blocks=4, block_size=4, dtype=torch.float32, kv_cache_dtype="int8"
    )
    assert pool.k_scales is not None and pool.v_scales is not None
    for t in (pool.k_cache, pool.v_cache):
        t.copy_(torch.randint(-127, 128, t.shape, generator=gen, dtype=torch.int8))
    for t in (pool.k_scales, pool.v_scales):
        t.copy_(torch.rand(t.shape, generator=gen))
    before = [t.clone() for t in (pool.k_cache, pool.v_cache, pool.k_scales, pool.v_scales)]
    ops.copy_blocks(pool.k_cache, pool.v_cache, [(1, 3), (3, 0)],
                    k_scales=pool.k_scales, v_scales=pool.v_scales)  # fmt: skip
    for old, new in zip(before, (pool.k_cache, pool.v_cache, pool.k_scales, pool.v_scales), strict=True):
        assert torch.equal(new[:, 3], old[:, 1]) and torch.equal(new[:, 0], old[:, 3])
        assert torch.equal(new[:, 1], old[:, 1]) and torch.equal(new[:, 2], old[:, 2])


def test_contiguous_pool_int8_fork_copies_scales(gen):
    pool = ContiguousKVPool.from_model_config(
        1, 2, HEAD_DIM, max_model_len=8, max_batch_size=2, dtype=torch.float32,
        kv_cache_dtype="int8",
    )  # fmt: skip
    seq = pool.allocate_seq(5)
    view = pool.view([seq], [5])
    view.update(0, torch.randn(5, 2, HEAD_DIM, generator=gen), torch.randn(5, 2, HEAD_DIM, generator=gen))
    view.advance()
    child = pool.fork_seq(seq)
    assert pool.k_scales is not None
    assert torch.equal(pool.k_scales[0, child, :5], pool.k_scales[0, seq, :5])
    assert (pool.k_scales[0, child, :5] > 0).all()
    k_parent, _ = pool.view([seq], [0]).update(0, torch.empty(0, 2, HEAD_DIM), torch.empty(0, 2, HEAD_DIM))
    k_child, _ = pool.view([child], [0]).update(0, torch.empty(0, 2, HEAD_DIM), torch.empty(0, 2, HEAD_DIM))
    assert k_child.dtype == torch.float32
    assert torch.equal(k_child, k_parent)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_table_gives_every_bit_pattern_its_cast_value(dtype: torch.dtype) -> None:
    """The CPU gather reads fp8 through a 256-entry table instead of torch's
    cast; both must agree on all 256 codes (NaN codes stay NaN)."""
    from paged_ref.gather import _fp8_values

    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    torch.testing.assert_close(_fp8_values(dtype), codes.float(), rtol=0, atol=0, equal_nan=True)
