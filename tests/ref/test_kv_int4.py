"""4-bit KV cache (``paged_ref.kv_int4``): the round trip's error bounds,
the reference ops on int4 blocks, and the pools' capacity at equal bytes."""

from __future__ import annotations

import pytest
import torch

from paged_ref import ContiguousKVPool, PagedKVPool, ops
from paged_ref.kv_int4 import (
    dequantize_values,
    key_group,
    pack,
    quantize_values,
    unpack,
)
from paged_ref.kv_spec import KVCacheSpec

HEAD_DIM = 16
FP16_REL = 2.0**-10  # float16 rounding of the stored scale and min (relative, generous)


def _write(pool, k, v, slots, layer=0):
    ops.write_kv(pool.k_cache[layer], pool.v_cache[layer], k, v, slots,
                 k_scales=pool.k_scales[layer], v_scales=pool.v_scales[layer])  # fmt: skip


def _read(pool, tables, lens, layer=0):
    k = ops.gather_context(pool.k_cache[layer], tables, lens, pool.k_scales[layer])
    v = ops.gather_context(pool.v_cache[layer], tables, lens, pool.v_scales[layer], is_key=False)
    return k.transpose(1, 2), v.transpose(1, 2)  # [batch, len, kv_heads, head_dim]


def _key_steps(k: torch.Tensor, group: int) -> torch.Tensor:
    """Each key's quantization step: its channel's range over its group / 15."""
    steps = torch.empty_like(k)
    for s in range(0, k.shape[0], group):
        part = k[s : s + group]
        steps[s : s + group] = (part.amax(0) - part.amin(0)) / 15
    return steps


def test_pack_unpack_two_codes_per_byte():
    q = torch.arange(16).repeat(2).view(2, 16)
    packed = pack(q)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 8)
    assert int(packed[0, 0]) == 0x10  # channel 0 low nibble, channel 1 high
    assert torch.equal(unpack(packed).long(), q)


def test_values_round_trip_within_half_a_step(gen):
    v = torch.randn(50, 3, 128, generator=gen) * torch.rand(50, 3, 1, generator=gen) * 10
    codes, scales = quantize_values(v)
    assert codes.shape == (50, 3, 64) and scales.shape == (50, 3, 2, 2)  # 2 groups of 64
    back = dequantize_values(codes, scales)
    x = v.view(50, 3, 2, 64)
    step = ((x.amax(-1) - x.amin(-1)) / 15).repeat_interleave(64, -1)
    absmax = v.abs().amax(-1, keepdim=True)
    assert ((back - v).abs() <= step / 2 + 16 * absmax * FP16_REL).all()


@pytest.mark.parametrize("block_size", [16, 64, 128])
def test_keys_round_trip_whole_groups_within_half_a_step(block_size, gen):
    """Keys written a group at a time (a prefill) are quantized once per
    channel: within half a step of their group's range, plus float16 rounding."""
    pool = PagedKVPool.from_model_config(1, 2, HEAD_DIM, 6, block_size, torch.float32,
                                         kv_cache_dtype="int4")  # fmt: skip
    n = 2 * block_size + 5
    k = torch.randn(n, 2, HEAD_DIM, generator=gen)
    k[:, :, 3] *= 20  # an outlier channel costs only its own precision (per channel)
    _write(pool, k, torch.randn(n, 2, HEAD_DIM, generator=gen), torch.arange(n))
    got, _ = _read(pool, torch.arange(3).view(1, 3), torch.tensor([n]))
    step = _key_steps(k, key_group(block_size))
    assert ((got[0] - k).abs() <= step / 2 + 16 * k.abs().amax(0) * FP16_REL).all()
    # the outlier channel does not coarsen the others
    others = [c for c in range(HEAD_DIM) if c != 3]
    assert (got[0][..., others] - k[..., others]).abs().max() < 0.5


@pytest.mark.parametrize("block_size", [16, 64])
def test_keys_written_token_by_token_stay_within_three_steps(block_size, gen):
    """Decode writes one key at a time: a group is re-quantized when its
    range grows, and re-rounding older keys adds up: here at most 2.2 steps
    of the final range for the worst key, 0.3 on average (one-shot: 0.5 and
    0.25). The bounds leave room; a lost group or a wrong scale is far off."""
    pool = PagedKVPool.from_model_config(1, 2, HEAD_DIM, 4, block_size, torch.float32,
                                         kv_cache_dtype="int4")  # fmt: skip
    n = block_size + block_size // 2
    k = torch.randn(n, 2, HEAD_DIM, generator=gen)
    v = torch.randn(n, 2, HEAD_DIM, generator=gen)
    for i in range(n):
        _write(pool, k[i : i + 1], v[i : i + 1], torch.tensor([i]))
    got_k, got_v = _read(pool, torch.arange(2).view(1, 2), torch.tensor([n]))
    err = (got_k[0] - k).abs() / _key_steps(k, key_group(block_size))
    assert err.max() <= 3.0
    assert err.mean() <= 0.35, err.mean()
    once = PagedKVPool.from_model_config(1, 2, HEAD_DIM, 4, block_size, torch.float32,
                                         kv_cache_dtype="int4")  # fmt: skip
    _write(once, k, v, torch.arange(n))
    _, once_v = _read(once, torch.arange(2).view(1, 2), torch.tensor([n]))
    assert torch.equal(got_v, once_v)  # values are per token: write order does not matter


def test_group_whose_range_does_not_grow_keeps_its_codes(gen):
    pool = PagedKVPool.from_model_config(1, 1, HEAD_DIM, 2, 16, torch.float32,
                                         kv_cache_dtype="int4")  # fmt: skip
    k = torch.randn(8, 1, HEAD_DIM, generator=gen)
    _write(pool, k, k, torch.arange(8))
    before = pool.k_cache[0, 0, :8].clone()
    inside = (k.amax(0) + k.amin(0)) / 2  # within every channel's range
    _write(pool, inside.unsqueeze(0), inside.unsqueeze(0), torch.tensor([8]))
    assert torch.equal(pool.k_cache[0, 0, :8], before)


def test_ops_attend_over_the_dequantized_cache(gen):
    """Decode and prefill attention over an int4 cache equal attention over
    its dequantized float32 copy, on a shuffled page table."""
    bs = 8
    pool = PagedKVPool.from_model_config(1, 2, HEAD_DIM, 8, bs, torch.float32,
                                         kv_cache_dtype="int4")  # fmt: skip
    n = 19
    k, v = torch.randn(n, 2, HEAD_DIM, generator=gen), torch.randn(n, 2, HEAD_DIM, generator=gen)
    tables = torch.tensor([[6, 1, 4]], dtype=torch.int32)
    slots = torch.tensor([int(tables[0, p // bs]) * bs + p % bs for p in range(n)])
    _write(pool, k[:12], v[:12], slots[:12])
    _write(pool, k[12:], v[12:], slots[12:])
    lens = torch.tensor([n], dtype=torch.int32)
    dense_k, dense_v = _read(pool, tables, lens)
    flat = torch.zeros(1, 3 * bs, 2, HEAD_DIM)
    flat[0, :n] = dense_k[0]
    k_deq = flat.view(3, bs, 2, HEAD_DIM)
    flat = torch.zeros(1, 3 * bs, 2, HEAD_DIM)
    flat[0, :n] = dense_v[0]
    v_deq = flat.view(3, bs, 2, HEAD_DIM)
    kw = {"k_scales": pool.k_scales[0], "v_scales": pool.v_scales[0]}
    q = torch.randn(1, 4, HEAD_DIM, generator=gen)
    dense_tables = torch.arange(3, dtype=torch.int32).view(1, 3)
    got = ops.paged_decode_attention(q, pool.k_cache[0], pool.v_cache[0], tables, lens, 0.3, **kw)
    want = ops.paged_decode_attention(q, k_deq, v_deq, dense_tables, lens, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    qp = torch.randn(5, 4, HEAD_DIM, generator=gen)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    got = ops.paged_prefill_attention(qp, pool.k_cache[0], pool.v_cache[0], tables, cu, lens,
                                      0.3, **kw)  # fmt: skip
    want = ops.paged_prefill_attention(qp, k_deq, v_deq, dense_tables, cu, lens, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (dense_k[0] - k).abs().max() < 0.6 and (dense_v[0] - v).abs().max() < 0.6


def test_copy_blocks_moves_codes_and_both_scales(gen):
    pool = PagedKVPool.from_model_config(2, 2, HEAD_DIM, 4, 8, torch.float32,
                                         kv_cache_dtype="int4")  # fmt: skip
    k, v = torch.randn(5, 2, HEAD_DIM, generator=gen), torch.randn(5, 2, HEAD_DIM, generator=gen)
    for layer in range(2):
        _write(pool, k, v, torch.arange(5) + 8, layer)  # block 1
    ops.copy_blocks(pool.k_cache, pool.v_cache, [(1, 3)], k_scales=pool.k_scales,
                    v_scales=pool.v_scales)  # fmt: skip
    for layer in range(2):
        a = _read(pool, torch.tensor([[1]]), torch.tensor([5]), layer)
        b = _read(pool, torch.tensor([[3]]), torch.tensor([5]), layer)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_contiguous_pool_reads_what_the_paged_pool_reads(gen):
    """One key group per 64 tokens in both pools (the contiguous row is one
    block of max_model_len): written alike, they read back alike."""
    n = 70
    k, v = torch.randn(n, 2, HEAD_DIM, generator=gen), torch.randn(n, 2, HEAD_DIM, generator=gen)
    paged = PagedKVPool.from_model_config(1, 2, HEAD_DIM, 4, 64, torch.float32,
                                          kv_cache_dtype="int4")  # fmt: skip
    contiguous = ContiguousKVPool.from_model_config(1, 2, HEAD_DIM, 200, 2, dtype=torch.float32,
                                                    kv_cache_dtype="int4")  # fmt: skip
    assert contiguous.k_scales.shape == (1, 2, 4, 2, 2, HEAD_DIM)  # ceil(200 / 64) groups
    _write(paged, k, v, torch.arange(n))
    _write(contiguous, k, v, torch.arange(n) + 200)  # row 1
    a = _read(paged, torch.tensor([[0, 1]]), torch.tensor([n]))
    b = _read(contiguous, torch.tensor([[1]]), torch.tensor([n]))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_int4_needs_an_even_head_dim_and_no_static_scales():
    with pytest.raises(ValueError, match="even head_dim"):
        PagedKVPool.from_model_config(1, 1, 15, 2, 16, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="not int4"):
        PagedKVPool.from_model_config(1, 1, 16, 2, 16, kv_cache_dtype="int4",
                                      kv_scales=(torch.ones(1, 1), torch.ones(1, 1)))  # fmt: skip


# Llama 3.2 1B: 16 layers, 8 kv heads, head_dim 64.
LLAMA_1B = dict(num_layers=16, num_kv_heads=8, head_dim=64)


@pytest.mark.parametrize(
    ("block_size", "vs_bf16", "vs_fp32"), [(64, 3.5, 7.0), (128, 3.5, 7.0), (16, 3.0, 6.0)]
)
def test_pools_hold_3_5x_a_16_bit_cache_at_equal_bytes(block_size, vs_bf16, vs_fp32):
    """Measured on the pools (meta tensors: sized, not allocated): the tokens
    a 1 GiB budget buys, and the bytes the pool's tensors really hold."""
    budget = 1 << 30

    def tokens(dtype: torch.dtype, name: str) -> tuple[int, int]:
        spec = KVCacheSpec.dense(
            LLAMA_1B["num_layers"], LLAMA_1B["num_kv_heads"], LLAMA_1B["head_dim"], dtype,
            kv_cache_dtype=name, block_size=block_size,
        )  # fmt: skip
        blocks = spec.blocks_in(budget)
        pool = PagedKVPool.from_model_config(**LLAMA_1B, num_blocks=blocks, block_size=block_size,
                                             dtype=dtype, device="meta", kv_cache_dtype=name)  # fmt: skip
        assert pool.kv_bytes() <= budget
        return blocks * block_size, pool.kv_bytes()

    int4, int4_bytes = tokens(torch.bfloat16, "int4")
    bf16, _ = tokens(torch.bfloat16, "auto")
    fp32, _ = tokens(torch.float32, "auto")
    assert int4_bytes > budget * 0.99  # the budget is really spent on int4 blocks
    assert int4 / bf16 >= vs_bf16 and int4 / fp32 >= vs_fp32
