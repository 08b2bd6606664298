"""The C decode kernel (``paged_ref.cpu.cpu_decode``) against the reference
``paged_decode_attention`` on random page tables: junk table entries, a NaN
block, zero-length sequences, sliding windows, soft-capping, GQA, every
16/32-bit cache dtype, one thread and two (sequences split by kv head when
there are fewer than threads); 8-bit caches and scales fall back to the
reference."""

from __future__ import annotations

import pytest
import torch

from paged_ref import ops
from paged_ref.cpu import cpu_decode
from paged_ref.cpu.cpu_backend import CpuKernelsBackend
from paged_ref.cpu.cpu_decode import CpuDecodeOps
from paged_ref.kv_quant import quantize
from paged_ref.paged_pool import PagedKVPool

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 4
NUM_BLOCKS = 64


def random_batch(gen: torch.Generator, batch: int, max_len: int, dtype: torch.dtype):
    """A batch whose tables point at random distinct blocks; entries past a
    sequence's blocks are junk (-1 or out of range) and one unused block is NaN."""
    lens = torch.randint(0, max_len + 1, (batch,), generator=gen)
    lens[0] = max_len
    width = max(1, -(-max_len // BLOCK))
    tables = torch.randint(-1, NUM_BLOCKS + 8, (batch, width), generator=gen, dtype=torch.int32)
    order = torch.randperm(NUM_BLOCKS - 1, generator=gen)
    used = 0
    for b in range(batch):
        n = -(-int(lens[b]) // BLOCK)
        tables[b, :n] = order[used : used + n].int()
        used += n
    k = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    k[NUM_BLOCKS - 1] = v[NUM_BLOCKS - 1] = float("nan")  # stale, reachable only through junk entries
    tables[tables == NUM_BLOCKS - 1] = 0
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    return q, k, v, tables, lens


@pytest.fixture(autouse=True)
def _own_build_dir(tmp_path_factory, monkeypatch):
    """Each test session builds the kernel itself (a stale cached build would hide a source change)."""
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "paged-cache"))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("dtype", "window", "softcap", "atol"),
    [
        (torch.float32, None, None, 1e-5),
        (torch.bfloat16, 6, None, 2e-2),
        (torch.float16, None, None, 2e-3),
        (torch.float32, None, 5.0, 1e-5),
        (torch.float32, 1, None, 1e-5),
    ],
)
def test_cpu_decode_matches_the_reference(dtype, window, softcap, atol, threads) -> None:
    gen = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for batch, max_len in [(1, 1), (1, 9), (5, 4), (7, 23), (12, 40), (3, 0)]:
            q, k, v, tables, lens = random_batch(gen, batch, max_len, dtype)
            assert cpu_decode.supports(q, k, v)
            want = ops.paged_decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5, window, softcap)
            got = cpu_decode.decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5, window, softcap)
            assert got.dtype == q.dtype and got.shape == q.shape
            assert not got.isnan().any()
            torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("q_scale", [8.0, 60.0])
def test_a_sharp_softmax_matches_the_reference(q_scale) -> None:
    """Scores hundreds apart: the kernel's own exp (``exp_simd``) runs over
    its whole range, down to arguments where e^x underflows to 0, and keeps
    each step's running max right."""
    gen = torch.Generator().manual_seed(3)
    for batch, max_len in [(4, 37), (5, 44)]:
        q, k, v, tables, lens = random_batch(gen, batch, max_len, torch.float32)
        q = q * q_scale
        want = ops.paged_decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5)
        got = cpu_decode.decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_nan_key_makes_its_query_nan_as_in_the_reference() -> None:
    """A NaN in a visible key reaches its query heads' output (the sampler
    then fails that request), as in the reference; the other heads and
    sequences are unharmed."""
    gen = torch.Generator().manual_seed(4)
    q, k, v, _, _ = random_batch(gen, 3, 20, torch.float32)
    tables = torch.arange(15, dtype=torch.int32).view(3, 5)  # 20 tokens each, own blocks
    lens = torch.full((3,), 20)
    k[1, 2, 0, 5] = float("nan")  # the first sequence's 7th token
    want = ops.paged_decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5)
    got = cpu_decode.decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5)
    nan = HEADS // KV_HEADS  # the query heads of kv head 0
    assert got[0, :nan].isnan().all() and torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0, equal_nan=True)


def test_a_block_larger_than_the_kernel_buffer_takes_the_reference() -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(3, 512, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    tables, lens = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32), torch.tensor([700, 300])
    want = ops.paged_decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5)
    got = cpu_decode.decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("cache", "codes"),
    [
        (torch.float8_e4m3fn, torch.arange(256, dtype=torch.uint8)),
        (torch.float8_e5m2, torch.arange(256, dtype=torch.uint8)),
        (torch.float16, torch.arange(-(2**15), 2**15, dtype=torch.int16)),
    ],
)
def test_the_kernel_reads_every_cache_code_as_torch_converts_it(cache, codes) -> None:
    """Each code, as a sequence's only value row (its one key and query are
    zero, so the output is that row), comes out as torch's own conversion:
    subnormals, the largest values, infinities and NaNs included."""
    v = codes.view(cache).reshape(-1, 1, 1, 16).expand(-1, 1, KV_HEADS, 16).contiguous()
    rows = v.shape[0]
    tables = torch.arange(rows, dtype=torch.int32).unsqueeze(1)
    q = torch.zeros(rows, HEADS, 16)
    got = cpu_decode.decode_attention(q, torch.zeros_like(v), v, tables, torch.ones(rows), 1.0)
    want = v[:, 0].float().repeat_interleave(HEADS // KV_HEADS, dim=1)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0, 1.0, -1.0), want.nan_to_num(0.0, 1.0, -1.0))


@pytest.mark.parametrize("cache", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_an_unscaled_fp8_cache_decodes_in_c_as_the_reference(monkeypatch, cache, act) -> None:
    """vLLM's plain ``fp8`` cache (no scales): the C kernels read it, and
    write a decode step's rows as the reference's saturating cast does."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, tables, lens = random_batch(gen, 7, 23, torch.float32)
    k8, v8 = (quantize(x, cache)[0] for x in (k, v))
    q = q.to(act)
    assert cpu_decode.supports(q, k8, v8)
    want = ops.paged_decode_attention(q, k8, v8, tables, lens, HEAD_DIM**-0.5)

    def no_reference(*args, **kwargs):
        raise AssertionError("the reference decode ran")

    cpu_ops = CpuDecodeOps(ops)
    monkeypatch.setattr(ops, "paged_decode_attention", no_reference)
    got = cpu_ops.paged_decode_attention(q, k8, v8, tables, lens, HEAD_DIM**-0.5)
    assert got.dtype == act
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 if act == torch.bfloat16 else 1e-5, rtol=0)
    k_new, v_new = (torch.randn(7, KV_HEADS, HEAD_DIM, generator=gen).to(act) * 300 for _ in range(2))
    slots = (tables[:, 0].long() * BLOCK + 1).clamp(min=0)  # a slot in each sequence's first block
    k_want, v_want = k8.clone(), v8.clone()
    monkeypatch.undo()
    ops.write_kv(k_want, v_want, k_new, v_new, slots)
    want = ops.paged_decode_attention(q, k_want, v_want, tables, lens.clamp(min=2), HEAD_DIM**-0.5)
    memo: dict = {}
    got = cpu_decode.write_and_decode(k8, v8, q, k_new, v_new, slots, tables, lens.clamp(min=2), HEAD_DIM**-0.5, None, None, memo)
    assert got is not None  # some values saturate: 300 x randn reaches past e4m3's 448
    assert torch.equal(k8.view(torch.uint8), k_want.view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), v_want.view(torch.uint8))
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 if act == torch.bfloat16 else 1e-5, rtol=2e-2)


@pytest.mark.parametrize("cache", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_fp8_write_rounds_and_saturates_as_the_reference(cache) -> None:
    """Every code's value, every midpoint between neighbouring codes (ties
    go to the even code), values past the largest, subnormals, zeros of
    both signs, infinities and NaNs: the C write stores the reference's
    code bit for bit."""
    codes = torch.arange(256, dtype=torch.uint8).view(cache).float()
    finite = codes[codes.isfinite()].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 1e-30, -1e-45, 1e30])
    gen = torch.Generator().manual_seed(8)
    spread = torch.randn(4096, generator=gen) * torch.pow(10.0, torch.empty(4096).uniform_(-9, 6, generator=gen))
    values = torch.cat([finite, mids, mids.nextafter(torch.tensor(float("inf"))), special, spread])
    values = torch.cat([values, values.new_zeros(-values.numel() % (KV_HEADS * HEAD_DIM))])
    rows = values.view(-1, KV_HEADS, HEAD_DIM)
    n = rows.shape[0]
    want, got = (torch.zeros(n, 1, KV_HEADS, HEAD_DIM, dtype=cache) for _ in range(2))
    slots = torch.arange(n)
    ops.write_kv(want, want.clone(), rows, rows, slots)
    assert cpu_decode.write_kv(got, got.clone(), rows, rows, slots)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_an_int8_cache_decodes_in_c_with_its_token_scales(monkeypatch, act) -> None:
    """int8 codes times their token's float16 scale, read in place; static
    per-head scales (``calculate_kv_scales``) still take the reference."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, tables, lens = random_batch(gen, 6, 21, torch.float32)
    q = q.to(act)
    (k8, ks), (v8, vs) = quantize(k * 3, torch.int8), quantize(v, torch.int8)
    args = (q, k8, v8, tables, lens, HEAD_DIM**-0.5)
    want = ops.paged_decode_attention(*args, k_scales=ks, v_scales=vs)
    heads = torch.rand(KV_HEADS, generator=gen) + 0.5
    want_static = ops.paged_decode_attention(*args, k_head_scales=heads, v_head_scales=heads)
    reference = ops.paged_decode_attention

    def no_reference(*args, **kwargs):
        raise AssertionError("the reference decode ran")

    monkeypatch.setattr(ops, "paged_decode_attention", no_reference)
    got = CpuDecodeOps(ops).paged_decode_attention(*args, k_scales=ks, v_scales=vs)
    assert got.dtype == act
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 if act == torch.bfloat16 else 1e-5, rtol=0)
    monkeypatch.setattr(ops, "paged_decode_attention", reference)
    static = CpuDecodeOps(ops).paged_decode_attention(*args, k_head_scales=heads, v_head_scales=heads)
    assert torch.equal(static, want_static)


def test_quantized_caches_are_written_by_the_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v, tables, lens = random_batch(gen, 4, 13, torch.float32)
    (k8, ks), (v8, vs) = quantize(k, torch.int8), quantize(v, torch.int8)
    assert CpuDecodeOps(ops).copy_blocks is ops.copy_blocks  # every other op is the wrapped module's
    k_new, v_new = (torch.randn(3, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    k_want, v_want, k_got, v_got = k8.clone(), v8.clone(), k8.clone(), v8.clone()
    ks_want, vs_want, ks_got, vs_got = ks.clone(), vs.clone(), ks.clone(), vs.clone()
    slots = torch.tensor([5, -1, 17])
    ops.write_kv(k_want, v_want, k_new, v_new, slots, k_scales=ks_want, v_scales=vs_want)
    CpuDecodeOps(ops).write_kv(k_got, v_got, k_new, v_new, slots, k_scales=ks_got, v_scales=vs_got)
    assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)
    assert torch.equal(ks_got.nan_to_num(), ks_want.nan_to_num())  # the test data's NaN block


@pytest.mark.parametrize(
    ("act", "cache"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
     (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
)  # fmt: skip
def test_cpu_write_and_decode_take_activations_in_their_own_dtype(act, cache) -> None:
    """q, k and v as a model hands them over: slices of one projection (rows
    apart by more than a row), in the activations' dtype, which may differ
    from the cache's; NaN and infinities survive the write as torch's cast keeps them."""
    gen = torch.Generator().manual_seed(3)
    _, k_cache, v_cache, tables, lens = random_batch(gen, 6, 21, cache)
    k_cache[NUM_BLOCKS - 1] = v_cache[NUM_BLOCKS - 1] = 0
    fused = torch.randn(6, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).to(act)
    fused[0, HEADS, :3] = torch.tensor([float("nan"), float("inf"), -1e30])
    q, k, v = fused.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=gen)[:6]
    slots[2] = -1
    k_want, v_want, k_got, v_got = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    ops.write_kv(k_want, v_want, k, v, slots)
    CpuDecodeOps(ops).write_kv(k_got, v_got, k, v, slots)
    assert torch.equal(k_got.isnan(), k_want.isnan())
    assert torch.equal(k_got.nan_to_num(), k_want.nan_to_num()) and torch.equal(v_got, v_want)
    assert cpu_decode.supports(q, k_want, v_want)
    k_want[k_want.isnan() | k_want.isinf()] = 0
    want = ops.paged_decode_attention(q, k_want, v_want, tables, lens, HEAD_DIM**-0.5)
    got = cpu_decode.decode_attention(q, k_want, v_want, tables, lens, HEAD_DIM**-0.5)
    assert got.dtype == act
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 if torch.bfloat16 in (act, cache) else 2e-3, rtol=0)


def test_an_out_of_range_slot_writes_nothing_and_raises_as_the_reference() -> None:
    gen = torch.Generator().manual_seed(4)
    _, k_cache, v_cache, _, _ = random_batch(gen, 2, 8, torch.float32)
    before = k_cache.clone()
    k, v = (torch.randn(2, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    assert not cpu_decode.write_kv(k_cache, v_cache, k, v, torch.tensor([3, NUM_BLOCKS * BLOCK]))
    assert torch.equal(k_cache.nan_to_num(), before.nan_to_num())
    with pytest.raises((IndexError, RuntimeError)):
        CpuDecodeOps(ops).write_kv(k_cache, v_cache, k, v, torch.tensor([3, NUM_BLOCKS * BLOCK]))


@pytest.mark.parametrize(("act", "cache"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.bfloat16)])  # fmt: skip
def test_write_and_decode_equals_the_two_reference_ops_layer_after_layer(act, cache) -> None:
    """A decode-only step through ``write_and_decode``: each layer's cache
    written and attended as ``write_kv`` then ``paged_decode_attention``
    would, the step's int32 tables made once (by the first layer) and a new
    step's tables made anew."""
    gen = torch.Generator().manual_seed(5)
    for _step in range(2):
        _, _, _, tables, lens = random_batch(gen, 5, 19, cache)
        lens = lens.clamp(min=1)
        slots = torch.stack([tables[b, (int(n) - 1) // BLOCK].long() * BLOCK + (int(n) - 1) % BLOCK
                             for b, n in enumerate(lens)])  # fmt: skip
        memo: dict = {}
        for _layer in range(3):
            _, k_cache, v_cache, _, _ = random_batch(gen, 1, 1, cache)
            fused = torch.randn(5, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).to(act)
            q, k, v = fused.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
            k_want, v_want = k_cache.clone(), v_cache.clone()
            ops.write_kv(k_want, v_want, k, v, slots)
            want = ops.paged_decode_attention(q, k_want, v_want, tables, lens, HEAD_DIM**-0.5, 7, None)
            got = cpu_decode.write_and_decode(k_cache, v_cache, q, k, v, slots, tables, lens,
                                              HEAD_DIM**-0.5, 7, None, memo)  # fmt: skip
            assert got is not None and got.dtype == act
            assert torch.equal(k_cache.nan_to_num(), k_want.nan_to_num()) and torch.equal(v_cache.nan_to_num(), v_want.nan_to_num())
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2 if torch.bfloat16 in (act, cache) else 1e-5, rtol=0)
            plan = memo[cpu_decode._PLAN]
            assert plan.block_tables is tables and plan.tables.dtype == torch.int32


def test_write_and_decode_declines_what_the_kernels_do_not_take() -> None:
    """None, nothing written: a slot out of range (the reference then raises),
    and a block larger than the kernel's buffer."""
    gen = torch.Generator().manual_seed(6)
    q, k_cache, v_cache, tables, lens = random_batch(gen, 2, 8, torch.float32)
    k, v = (torch.randn(2, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    before = k_cache.clone()
    bad = torch.tensor([3, NUM_BLOCKS * BLOCK])
    assert cpu_decode.write_and_decode(k_cache, v_cache, q, k, v, bad, tables, lens, 1.0, None, None, {}) is None
    assert torch.equal(k_cache.nan_to_num(), before.nan_to_num())
    big = torch.zeros(2, cpu_decode.MAX_BLOCK + 1, KV_HEADS, HEAD_DIM)
    slots = torch.tensor([0, 1])
    assert cpu_decode.write_and_decode(big, big.clone(), q, k, v, slots, tables, lens, 1.0, None, None, {}) is None
    assert not big.any()


@pytest.mark.parametrize(
    ("dtype", "window", "softcap", "atol"),
    [
        (torch.bfloat16, None, None, 3e-2),
        (torch.bfloat16, 6, None, 3e-2),
        (torch.float16, None, None, 4e-3),
        (torch.bfloat16, None, 5.0, 0.0),  # soft-capped: the float32 reference itself
        (torch.float32, None, None, 0.0),  # 32-bit: the reference itself
        (torch.float8_e4m3fn, None, None, 3e-2),  # a bf16 model over an fp8 cache
        (torch.float8_e5m2, 6, None, 3e-2),
    ],
)
def test_cpu_prefill_in_the_model_dtype_matches_the_reference(monkeypatch, dtype, window, softcap, atol) -> None:
    """CpuDecodeOps' prefill (SDPA in a 16-bit model's dtype) against the
    float32 reference: chunks after cached context, several sequences, GQA,
    lengths SDPA gets padded to a multiple of 16 (the padding taken from
    stale NaN slots of a last block, and past a sequence's blocks)."""
    gen = torch.Generator().manual_seed(1)
    cache = dtype
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        dtype = torch.bfloat16
    _, k, v, tables, lens = random_batch(gen, 3, 14, cache)
    lens = torch.tensor([14, 9, 5])
    for b, n in enumerate(lens.tolist()):  # a last block's unwritten slots: stale, here NaN
        last = int(tables[b, (n - 1) // BLOCK])
        k[last, n % BLOCK or BLOCK :] = v[last, n % BLOCK or BLOCK :] = float("nan")
    q_lens = torch.tensor([5, 9, 2])  # the second has no cached context
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).int()
    q = torch.randn(int(q_lens.sum()), HEADS, HEAD_DIM, generator=gen).to(dtype)
    args = (q, k, v, tables, cu, lens.int(), 0.3, window, softcap)
    want = ops.paged_prefill_attention(*args, memo={})
    if atol:  # the 16-bit path, never the reference

        def no_reference(*args, **kwargs):
            raise AssertionError("the reference prefill ran")

        monkeypatch.setattr(ops, "paged_prefill_attention", no_reference)
    got = CpuDecodeOps().paged_prefill_attention(*args, memo={})
    assert got.dtype == dtype and not got.isnan().any()
    if atol:
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
    else:
        assert torch.equal(got, want)


def _mixed_step(ops_module, gen: torch.Generator, dtype: torch.dtype, window: int | None):
    """One step of a paged pool with ``ops_module``: a decode between two
    prompt chunks (so rows are picked out of the flat batch), one chunk fresh
    and one after 6 cached tokens. Returns each layer's output, the caches
    and the step's metadata."""
    pool = PagedKVPool.from_model_config(2, KV_HEADS, HEAD_DIM, 32, BLOCK, dtype, ops=ops_module)
    lens = {"a": 6, "b": 9, "c": 5}  # a: cached 6, then a chunk of 5; b: decode at 9; c: fresh 5
    seqs = {name: pool.allocate_sequence(list(range(1, n + 1)))[0] for name, n in lens.items()}
    first = pool.step_view([seqs["a"], seqs["b"]], [0, 0], [6, 8])
    for layer in range(2):
        k, v = (torch.randn(14, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
        first.attend(layer, torch.randn(14, HEADS, HEAD_DIM, generator=gen).to(dtype), k, v,
                     scale=HEAD_DIM**-0.5, sliding_window=window)  # fmt: skip
    first.advance()
    pool.reserve(seqs["a"], list(range(1, 12)), 11)
    view = pool.step_view([seqs["a"], seqs["b"], seqs["c"]], [6, 8, 0], [5, 1, 5])
    outs = []
    for layer in range(2):
        fused = torch.randn(11, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        q, k, v = fused.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
        outs.append(view.attend(layer, q, k, v, scale=HEAD_DIM**-0.5, sliding_window=window))
    return outs, pool, view.meta


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_short_prompt_chunk_attends_as_decodes_like_the_prefill(monkeypatch, window, dtype) -> None:
    """A step whose prompt chunks read few keys runs each row as a decode of
    its own through ``write_and_decode`` (``CpuKernelsBackend.attend``): same
    outputs and caches as the reference prefill, which a threshold of 0 keeps."""
    results = {}
    for threshold in (0, 10**6):
        monkeypatch.setattr(CpuDecodeOps, "prefill_as_decodes", threshold)
        results[threshold] = _mixed_step(CpuKernelsBackend(CpuDecodeOps(ops)), torch.Generator().manual_seed(3), dtype, window)
    (want, want_pool, want_meta), (got, got_pool, got_meta) = results[0], results[10**6]
    assert "as_decodes" in got_meta.memo and "as_decodes" not in want_meta.memo
    assert got_meta.decode.rows is not None  # the rows were out of order
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), atol=atol, rtol=0)
    assert torch.equal(got_pool.k_cache, want_pool.k_cache) and torch.equal(got_pool.v_cache, want_pool.v_cache)


def test_prefill_key_reads_and_the_rows_as_decodes(monkeypatch) -> None:
    """The keys a step's prompt chunks read (decodes not counted), and each
    row as a decode: its sequence's page table, its position + 1 keys; the
    threshold is inclusive."""
    for threshold, expect in ((6 * 5 + 15 + 15 - 1, False), (6 * 5 + 15 + 15, True)):
        monkeypatch.setattr(CpuDecodeOps, "prefill_as_decodes", threshold)
        _, _, meta = _mixed_step(CpuKernelsBackend(CpuDecodeOps(ops)), torch.Generator().manual_seed(4), torch.float32, None)
        assert meta.prefill_key_reads() == 6 * 5 + 15 + 15  # a: 7..11, c: 1..5
        assert ("as_decodes" in meta.memo) is expect
    rows = meta.as_decodes()
    assert rows.seq_lens.tolist() == [7, 8, 9, 10, 11, 9, 1, 2, 3, 4, 5]
    assert torch.equal(rows.block_tables[0], meta.block_tables[0])
    assert torch.equal(rows.block_tables[5], meta.block_tables[1])
    assert torch.equal(rows.block_tables[10], meta.block_tables[2])
