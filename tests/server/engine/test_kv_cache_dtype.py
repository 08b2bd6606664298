"""An 8-bit KV cache is still a cache: with ``kv_cache_dtype="int8"`` the
paged pool, the contiguous pool, prefix caching, chunked prefill, forced
preemption and n > 1 forks all give the tokens of the plainest int8 engine;
and at equal KV bytes the 8-bit pools hold about twice the tokens."""

from __future__ import annotations

import pytest

from paged_server.entrypoints.openai.app import ServerSettings
from paged_server.entrypoints.openai.server import startup_line
from paged_server.sampling_params import SamplingParams

SEED_STRIDE = 0x9E3779B97F4A7C15  # choice i of a seeded request uses seed + i * this


def workload(prompt_of, greedy):
    shared = prompt_of(9, 100)
    return [
        (f"r{i}", (shared if i % 2 else []) + prompt_of(3 + 5 * i, i), greedy(10, logprobs=0))
        for i in range(6)
    ]


def across_backends_tol(attention_backend: str) -> float:
    """Logprob tolerance against a reference run on the ``ref`` backend. The
    same backend differs by fp32 noise (~1e-6). Another backend's kernels
    round differently, and in a later layer that can move one K/V element
    across an 8-bit rounding boundary: one int8 code step moved a logprob by
    4e-4 on a CI machine (Triton interpreter on an Intel Xeon). A wrong block
    or scale moves logprobs by far more and changes tokens, compared exactly."""
    return 1e-4 if attention_backend == "ref" else 2e-3


def assert_same(run, ref, requests, logprob_tol: float = 1e-4) -> None:
    for request_id, _, _ in requests:
        got, want = run.choices[(request_id, 0)], ref.choices[(request_id, 0)]
        assert got.token_ids == want.token_ids, request_id
        assert got.error is None and got.finish_reason == want.finish_reason == "length"
        assert got.logprobs == pytest.approx(want.logprobs, abs=logprob_tol)


@pytest.fixture(params=[False, True], ids=["per_token_scales", "calculated_scales"])
def int8_reference(request, make_engine, run_engine, prompt_of, greedy):
    """Contiguous int8 pool, no prefix cache, whole prompts: the plainest path;
    with per-token scales, or static ones from ``calculate_kv_scales``."""
    calculated = request.param
    requests = workload(prompt_of, greedy)
    engine = make_engine(kv_cache_backend="contiguous", max_batch_size=4, kv_cache_dtype="int8",
                         calculate_kv_scales=calculated)  # fmt: skip
    if calculated:  # static scales replace the per-token ones
        assert engine.worker.tensors.k_scales is None and engine.worker.tensors.k_head_scales is not None
    return requests, run_engine(engine, requests), calculated


@pytest.mark.backend
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_int8_paged_matches_int8_contiguous(
    int8_reference, make_engine, run_engine, attention_backend, prefix_caching
) -> None:
    requests, ref, calculated = int8_reference
    engine = make_engine(
        max_batch_size=4, kv_cache_dtype="int8", attention_backend=attention_backend,
        enable_prefix_caching=prefix_caching, calculate_kv_scales=calculated,
    )  # fmt: skip
    assert_same(run_engine(engine, requests), ref, requests, across_backends_tol(attention_backend))
    if prefix_caching:
        assert engine.metrics()["prefix_cache_hits_total"] > 0  # quantized blocks reused
    assert engine.audit() == []


def test_int8_chunked_prefill_under_block_pressure_matches(
    int8_reference, make_engine, run_engine
) -> None:
    requests, ref, calculated = int8_reference
    engine = make_engine(
        max_batch_size=4, kv_cache_dtype="int8", max_num_batched_tokens=8, num_gpu_blocks=14,
        calculate_kv_scales=calculated,
    )  # fmt: skip
    assert_same(run_engine(engine, requests), ref, requests)
    assert engine.audit() == []


@pytest.mark.backend
@pytest.mark.parametrize(
    ("kv_cache_dtype", "calculated"), [("int8", False), ("int8", True), ("fp8_e5m2", True)]
)
def test_int8_forced_preemption_matches_unpressured_run(
    make_engine, run_engine, prompt_of, greedy, attention_backend, kv_cache_dtype, calculated
) -> None:
    requests = [(f"g{i}", prompt_of(4 + i, 50 + i), greedy(16, logprobs=0)) for i in range(3)]
    kw = dict(kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=calculated)
    roomy = run_engine(make_engine(**kw), requests)
    engine = make_engine(attention_backend=attention_backend, num_gpu_blocks=7, **kw)
    assert_same(run_engine(engine, requests), roomy, requests, across_backends_tol(attention_backend))
    assert engine.metrics()["num_preemptions_total"] > 0
    assert engine.audit() == []


@pytest.mark.backend
@pytest.mark.parametrize("prompt_len", [12, 10])  # full last block / shared partial block (CoW)
@pytest.mark.parametrize("calculate_kv_scales", [False, True])  # per-token / static scales
def test_int8_forks_match_separate_requests(
    make_engine, run_engine, prompt_of, attention_backend, prompt_len, calculate_kv_scales
) -> None:
    """n=3 choices share the prompt's int8 blocks (a partial last block is
    copied on write, scales included) and sample exactly as three n=1
    requests with the choices' seeds, each with its own blocks."""
    prompt = prompt_of(prompt_len, 9)
    kw = dict(kv_cache_dtype="int8", attention_backend=attention_backend,
              enable_prefix_caching=False, calculate_kv_scales=calculate_kv_scales)  # fmt: skip
    forked = make_engine(**kw)
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=123, ignore_eos=True,
                            logprobs=0)  # fmt: skip
    run = run_engine(forked, [("n3", prompt, params)])
    assert (forked.kv_manager.stats()["cow_copies"] > 0) == bool(prompt_len % 4)
    separate = make_engine(**kw)
    singles = [
        (f"s{i}", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=(123 + i * SEED_STRIDE) % 2**64,
                                         ignore_eos=True, logprobs=0))  # fmt: skip
        for i in range(3)
    ]
    ref = run_engine(separate, singles)
    for i in range(3):
        assert run.tokens("n3", i) == ref.tokens(f"s{i}")
        assert run.choices[("n3", i)].logprobs == pytest.approx(
            ref.choices[(f"s{i}", 0)].logprobs, abs=1e-4
        )
    assert forked.audit() == [] and separate.audit() == []


def test_int8_cache_changes_outputs_only_slightly(
    int8_reference, make_engine, run_engine
) -> None:
    """The cache really is quantized (logprobs move) but a wide-init model
    still mostly agrees with float32 KV; calculated scales are really another
    scheme than per-token ones."""
    requests, int8_run, calculated = int8_reference
    full = run_engine(make_engine(kv_cache_backend="contiguous", max_batch_size=4), requests)
    deltas = [
        abs(a - b)
        for rid, _, _ in requests
        for a, b, ta, tb in zip(int8_run.choices[(rid, 0)].logprobs, full.choices[(rid, 0)].logprobs,
                                int8_run.tokens(rid), full.tokens(rid), strict=True)  # fmt: skip
        if ta == tb
    ]
    assert max(deltas) > 0  # not silently float32
    agree = sum(int8_run.tokens(r) == full.tokens(r) for r, _, _ in requests)
    assert agree >= len(requests) // 2
    if calculated:
        per_token = run_engine(make_engine(kv_cache_backend="contiguous", max_batch_size=4,
                                           kv_cache_dtype="int8"), requests)  # fmt: skip
        assert any(int8_run.choices[(r, 0)].logprobs != per_token.choices[(r, 0)].logprobs
                   for r, _, _ in requests)  # fmt: skip


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_equal_kv_bytes_hold_about_twice_the_tokens(make_engine, backend) -> None:
    budget = 1 << 20
    tokens = {}
    for dtype in ("auto", "fp8", "fp8_e5m2", "int8"):
        engine = make_engine(kv_cache_backend=backend, kv_cache_dtype=dtype,
                             kv_cache_memory_bytes=budget, max_batch_size=256, max_model_len=64,
                             max_num_batched_tokens=256)  # fmt: skip
        tokens[dtype] = engine.capacity.tokens
        assert engine.capacity.kv_bytes <= budget
        assert engine.metrics()["kv_capacity_tokens"] == tokens[dtype]
    # float32 model: fp8 is exactly 4x; int8 pays 2 scale bytes per 16 (head_dim) codes.
    assert tokens["fp8"] == tokens["fp8_e5m2"] >= 4 * tokens["auto"] - 64
    assert tokens["int8"] >= int(4 * 16 / 18 * tokens["auto"]) - 64
    assert tokens["int8"] < tokens["fp8"]


def test_startup_line_states_kv_dtype_and_capacity(make_engine) -> None:
    engine = make_engine(kv_cache_dtype="int8", num_gpu_blocks=10)
    line = startup_line(engine, ServerSettings(model_name="tiny"), "http://127.0.0.1:1")
    assert "KV cache int8 (kv_cache_dtype=int8): capacity 40 tokens in 10 blocks of 4" in line
    contiguous = make_engine(kv_cache_backend="contiguous", max_batch_size=3)
    n = contiguous.config.max_model_len
    line = startup_line(contiguous, ServerSettings(model_name="tiny"), "http://127.0.0.1:1")
    assert f"capacity {3 * n} tokens in 3 rows of {n}" in line  # a row, not a "slot"


def test_startup_line_states_the_model_dtype_and_why(make_engine) -> None:
    line = startup_line(make_engine(), ServerSettings(model_name="tiny"), "http://127.0.0.1:1")
    assert "dtype=float32 (auto: CPU has no AMX/AVX512-BF16)" in line  # the suite forces no bf16
    line = startup_line(make_engine(dtype="float32"), ServerSettings(model_name="tiny"), "http://127.0.0.1:1")
    assert "dtype=float32 kv_cache_backend=" in line  # chosen, not detected
