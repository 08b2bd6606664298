"""Triton ops on 8-bit KV caches (int8 with per-token-per-head scales, fp8
e4m3 and e5m2 with a per-tensor scale of 1, and both with static per-head
scales from calculate_kv_scales) against paged_ref.ops, on randomized page
tables. The interpreter handles fp8 loads, stores and casts,
so every kv dtype runs here; the GPU code of the fp8 variants is compiled by
the compile matrix. Tolerances: see conftest.py."""

from __future__ import annotations

import pytest
import torch

from paged_ref import PagedKVPool
from paged_ref import ops as ref_ops
from paged_ref.kv_quant import as_bits
from paged_triton import ops
from paged_triton.decode_splits import SplitPolicy

# Triton has no e4m3 conversions before sm_89 (the ops refuse it with a clear error there).
E4M3_UNSUPPORTED = torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9)
KV_DTYPES = [
    pytest.param(torch.int8, id="int8"),
    pytest.param(
        torch.float8_e4m3fn, id="fp8_e4m3",
        marks=pytest.mark.skipif(E4M3_UNSUPPORTED, reason="fp8 e4m3 needs sm_89+ in Triton"),
    ),
    pytest.param(torch.float8_e5m2, id="fp8_e5m2"),
]
SPLIT = SplitPolicy(min_chunk=64, target_programs=1 << 20, max_splits=4)
# heads, kv_heads, head_dim, block_size, sliding_window, softcap
CASES = [
    pytest.param(8, 2, 64, 16, None, None, id="gqa4-d64-bs16"),
    pytest.param(4, 1, 80, 8, 40, 2.0, id="mqa-d80-bs8-win-cap"),
]
ARGS = ("heads", "kv_heads", "head_dim", "block_size", "window", "softcap")
Q_DTYPES = [pytest.param(torch.float32, id="q-fp32"), pytest.param(torch.float16, id="q-fp16")]


def scales_of(k_scales, v_scales) -> dict:
    return {"k_scales": k_scales, "v_scales": v_scales}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(as_bits(a), as_bits(b))


def write_inputs(kv_heads, head_dim, num_slots, new_dtype, outliers, gen, paged, tokens=20):
    """New K and V, ``[tokens, kv_heads, head_dim]`` views into one fused QKV
    tensor (token 3 all zero; ``outliers``: ``(token, dim) -> value`` in every
    head), and random slots of which two are padding (-1)."""
    fused = torch.randn(tokens, 3 * kv_heads, head_dim, generator=gen) * 4
    fused[3] = 0.0  # an all-zero token
    for (token, dim), value in outliers.items():
        fused[token, :, dim] = value
    fused = fused.to(paged.device, new_dtype)
    k, v = fused[:, kv_heads : 2 * kv_heads], fused[:, 2 * kv_heads :]
    slots = torch.randperm(num_slots, generator=gen)[:tokens]
    slots[[0, 11]] = -1
    return k, v, slots.to(paged.device)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("new_dtype", [torch.float32, torch.float16], ids=["new-fp32", "new-fp16"])
def test_write_kv_codes_and_scales_are_bit_identical(kv_dtype, new_dtype, gen, paged):
    kv_heads, head_dim, block_size, num_blocks = 3, 80, 8, 10
    k_cache, v_cache, k_scales, v_scales = paged.random_quantized_caches(
        num_blocks, kv_heads, block_size, head_dim, kv_dtype, gen
    )
    # token 3 (all zero): scale 0, codes 0; outliers: int8 coarse for this token
    # only, fp8 e4m3 saturates
    k, v, slots = write_inputs(
        kv_heads, head_dim, num_blocks * block_size, new_dtype, {(5, 7): 900.0}, gen, paged
    )
    expected = [t.clone() if t is not None else None for t in (k_cache, v_cache, k_scales, v_scales)]
    ref_ops.write_kv(expected[0], expected[1], k, v, slots, **scales_of(expected[2], expected[3]))
    ops.write_kv(k_cache, v_cache, k, v, slots, **scales_of(k_scales, v_scales))
    assert bits_equal(k_cache, expected[0]) and bits_equal(v_cache, expected[1])
    if k_scales is not None:
        assert torch.equal(k_scales, expected[2]) and torch.equal(v_scales, expected[3])


def decode_inputs(
    lens, heads, kv_heads, head_dim, block_size, kv_dtype, q_dtype, gen, paged, static=False
):
    """Decode arguments over random 8-bit caches, and the scales as the ops'
    keywords: per-token ones, or static per-head ones when ``static``."""
    num_blocks = paged.blocks_needed(lens, block_size)
    caches = paged.random_static_quantized_caches if static else paged.random_quantized_caches
    k_cache, v_cache, k_scales, v_scales = caches(
        num_blocks, kv_heads, block_size, head_dim, kv_dtype, gen
    )
    tables = paged.random_block_tables(lens, block_size, num_blocks, gen).to(paged.device)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(paged.device, q_dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=paged.device)
    if static:
        return (q, k_cache, v_cache, tables, seq_lens), {
            "k_head_scales": k_scales, "v_head_scales": v_scales,
        }  # fmt: skip
    return (q, k_cache, v_cache, tables, seq_lens), scales_of(k_scales, v_scales)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("new_dtype", [torch.float32, torch.float16], ids=["new-fp32", "new-fp16"])
def test_write_kv_with_head_scales_is_bit_identical(kv_dtype, new_dtype, gen, paged):
    """value / scale, rounded (int8) or cast (fp8), saturating beyond the range."""
    kv_heads, head_dim, block_size, num_blocks = 3, 80, 8, 10
    k_cache, v_cache, k_head, v_head = paged.random_static_quantized_caches(
        num_blocks, kv_heads, block_size, head_dim, kv_dtype, gen
    )
    outliers = {(5, 7): 1e4, (6, 9): -1e4}  # far beyond every head's calibrated range: saturate
    k, v, slots = write_inputs(
        kv_heads, head_dim, num_blocks * block_size, new_dtype, outliers, gen, paged
    )
    heads = {"k_head_scales": k_head, "v_head_scales": v_head}
    expected = (k_cache.clone(), v_cache.clone())
    ref_ops.write_kv(*expected, k, v, slots, **heads)
    ops.write_kv(k_cache, v_cache, k, v, slots, **heads)
    assert bits_equal(k_cache, expected[0]) and bits_equal(v_cache, expected[1])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("q_dtype", Q_DTYPES)
@pytest.mark.parametrize(ARGS, CASES)
def test_head_scale_decode_and_prefill_match_reference(
    heads, kv_heads, head_dim, block_size, window, softcap, q_dtype, kv_dtype, gen, paged
):
    lens = [200, 3 * block_size, 1, block_size - 1, 130]
    args, scales = decode_inputs(
        lens, heads, kv_heads, head_dim, block_size, kv_dtype, q_dtype, gen, paged, static=True
    )
    scale = head_dim**-0.5
    out = paged.decode_attention(*args, scale, window, softcap, policy=SPLIT, **scales)
    expected = ref_ops.paged_decode_attention(*args, scale, window, softcap, **scales)
    paged.assert_close(out, expected, q_dtype)
    q_lens = [60, 2 * block_size, 1, 0, 7]
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(cu[-1]), heads, head_dim, generator=gen).to(paged.device, q_dtype)
    pre = (q, args[1], args[2], args[3], cu.to(paged.device), args[4])
    out = ops.paged_prefill_attention(*pre, scale, window, softcap, **scales)
    expected = ref_ops.paged_prefill_attention(*pre, scale, window, softcap, **scales)
    paged.assert_close(out, expected, q_dtype)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("q_dtype", Q_DTYPES)
@pytest.mark.parametrize("policy", [None, SPLIT], ids=["auto-split", "split"])
@pytest.mark.parametrize(ARGS, CASES)
def test_quantized_decode_matches_reference(
    heads, kv_heads, head_dim, block_size, window, softcap, policy, q_dtype, kv_dtype, gen, paged
):
    lens = [200, 3 * block_size, 1, block_size - 1, 130]
    args, scales = decode_inputs(
        lens, heads, kv_heads, head_dim, block_size, kv_dtype, q_dtype, gen, paged
    )
    scale = head_dim**-0.5
    out = paged.decode_attention(*args, scale, window, softcap, policy=policy, **scales)
    expected = ref_ops.paged_decode_attention(*args, scale, window, softcap, **scales)
    paged.assert_close(out, expected, q_dtype)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("q_dtype", Q_DTYPES)
@pytest.mark.parametrize(ARGS, CASES)
def test_quantized_prefill_matches_reference(
    heads, kv_heads, head_dim, block_size, window, softcap, q_dtype, kv_dtype, gen, paged
):
    seqs = [(100, 60), (2 * block_size, 2 * block_size), (block_size + 3, 1), (40, 0)]
    lens = [n for n, _ in seqs]
    (_, k_cache, v_cache, tables, seq_lens), scales = decode_inputs(
        lens, heads, kv_heads, head_dim, block_size, kv_dtype, q_dtype, gen, paged
    )
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor([q for _, q in seqs]).cumsum(0)
    q = torch.randn(int(cu[-1]), heads, head_dim, generator=gen).to(paged.device, q_dtype)
    args = (q, k_cache, v_cache, tables, cu.to(paged.device), seq_lens)
    scale = head_dim**-0.5
    out = ops.paged_prefill_attention(*args, scale, window, softcap, **scales)
    expected = ref_ops.paged_prefill_attention(*args, scale, window, softcap, **scales)
    paged.assert_close(out, expected, q_dtype)


@pytest.mark.parametrize("static", [False, True], ids=["per-token", "head-scales"])
def test_step_memo_replays_with_each_layers_scales(static, gen, paged):
    """Replayed layers must read their own int8 scales, not the first layer's."""
    lens, memo, step = [130, 16, 5], {}, None
    for _ in range(3):
        args, scales = decode_inputs(
            lens, 8, 2, 64, 16, torch.int8, torch.float32, gen, paged, static=static
        )
        if step is not None:
            args = (*args[:3], *step)
        step = args[3:]
        out = paged.decode_attention(*args, 0.125, memo=memo, policy=SPLIT, **scales)
        paged.assert_close(out, ref_ops.paged_decode_attention(*args, 0.125, **scales),
                           torch.float32)  # fmt: skip
    assert sum(key[0] == "paged_triton.decode" for key in memo) == 1


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(
    "pairs", [[[1, 4], [2, 5], [1, 6]], [[1, 2], [2, 3], [3, 1]]], ids=["fork", "cycle"]
)
def test_copy_blocks_copies_codes_and_scales(kv_dtype, pairs, gen, paged):
    layers, num_blocks, block_size, kv_heads, head_dim = 2, 8, 4, 2, 32
    caches = [paged.random_quantized_caches(num_blocks, kv_heads, block_size, head_dim, kv_dtype,
                                            gen) for _ in range(layers)]  # fmt: skip
    k, v = torch.stack([c[0] for c in caches]), torch.stack([c[1] for c in caches])
    ks = vs = None
    if kv_dtype == torch.int8:
        ks, vs = torch.stack([c[2] for c in caches]), torch.stack([c[3] for c in caches])
    expected = [t.clone() if t is not None else None for t in (k, v, ks, vs)]
    ref_ops.copy_blocks(expected[0], expected[1], pairs, **scales_of(expected[2], expected[3]))
    ops.copy_blocks(k, v, pairs, **scales_of(ks, vs))
    assert bits_equal(k, expected[0]) and bits_equal(v, expected[1])
    if ks is not None:
        assert torch.equal(ks, expected[2]) and torch.equal(vs, expected[3])


@pytest.mark.cuda
def test_e4m3_before_sm89_is_refused_with_the_alternatives(paged):
    if not E4M3_UNSUPPORTED:
        pytest.skip("needs a CUDA GPU older than sm_89")
    cache = torch.zeros(2, 4, 1, 32, dtype=torch.float8_e4m3fn, device=paged.device)
    new = torch.ones(1, 1, 32, device=paged.device)
    with pytest.raises(ValueError, match="fp8_e5m2 or int8"):
        ops.write_kv(cache, cache.clone(), new, new, torch.zeros(1, dtype=torch.long,
                                                                 device=paged.device))  # fmt: skip


@pytest.mark.backend
@pytest.mark.parametrize(
    ("kv_cache_dtype", "static"), [("int8", False), ("int8", True), ("fp8_e5m2", True)],
    ids=["int8", "int8-head-scales", "fp8_e5m2-head-scales"],
)  # fmt: skip
def test_8bit_pool_on_triton_ops_matches_reference_pool(kv_cache_dtype, static, gen, paged):
    """A whole view (write, prefill, fork with copy-on-write, decode) on an
    8-bit pool: the Triton ops and the reference ops agree (static scales:
    each layer its own, copy_blocks with no scales to copy)."""
    outs = []
    kv_scales = None
    if static:
        kv_scales = (torch.tensor([[0.02, 0.05], [0.01, 0.03]]), torch.tensor([[0.03, 0.02], [0.04, 0.01]]))
    for backend in (ref_ops, ops):
        g = torch.Generator().manual_seed(1)
        pool = PagedKVPool.from_model_config(2, 2, 32, num_blocks=12, block_size=4,
                                             dtype=torch.float32, device=paged.device,
                                             ops=backend, kv_cache_dtype=kv_cache_dtype,
                                             kv_scales=kv_scales)  # fmt: skip
        seq = pool.allocate_seq(0)
        def rand(*shape, g=g):
            return torch.randn(*shape, generator=g).to(paged.device)

        layer_outs = []
        view = pool.view([seq], [10])
        for layer in range(2):
            layer_outs.append(view.attend(layer, rand(10, 4, 32), rand(10, 2, 32), rand(10, 2, 32),
                                          scale=0.2))  # fmt: skip
        view.advance()
        child = pool.fork_seq(seq)
        view = pool.decode_view([seq, child])
        for layer in range(2):
            layer_outs.append(view.attend(layer, rand(2, 4, 32), rand(2, 2, 32), rand(2, 2, 32),
                                          scale=0.2))  # fmt: skip
        outs.append(layer_outs)
        assert pool.audit() == []
    for got, want in zip(outs[1], outs[0], strict=True):
        paged.assert_close(got, want, torch.float32)
