"""Workload generators: deterministic per seed, within their documented ranges."""

from __future__ import annotations

import pytest

from paged_server.bench.workloads import (
    make_workload,
    nano_vllm_workload,
    seed_workload,
    shared_prefix_workload,
)

POOL = list(range(3, 500))


def test_same_seed_same_requests_other_seed_differs() -> None:
    a = seed_workload(POOL, seed=7)
    b = seed_workload(POOL, seed=7)
    c = seed_workload(POOL, seed=8)
    assert a.requests == b.requests
    assert a.requests != c.requests


def test_seed_workload_matches_design_shape() -> None:
    w = seed_workload(POOL)
    assert len(w.requests) == 48
    for r in w.requests:
        assert 128 <= len(r.prompt_token_ids) <= 384
        assert 128 <= r.max_tokens <= 256
        assert set(r.prompt_token_ids) <= set(POOL)
    assert len({r.request_id for r in w.requests}) == 48
    # 48 x (384 + 256) tokens fit in 8 x 4096 token slots: the whole point of the workload
    assert w.max_model_len <= 640


def test_nano_vllm_shape_and_scaling_keeps_draws() -> None:
    full = nano_vllm_workload(POOL, num_requests=20)
    for r in full.requests:
        assert 100 <= len(r.prompt_token_ids) <= 1024
        assert 100 <= r.max_tokens <= 1024
    small = nano_vllm_workload(POOL, num_requests=20, prompt_scale=0.25, new_tokens_scale=0.125)
    for big, little in zip(full.requests, small.requests, strict=True):
        assert len(little.prompt_token_ids) == max(1, round(len(big.prompt_token_ids) * 0.25))
        assert little.max_tokens == max(1, round(big.max_tokens * 0.125))


def test_shared_prefix_requests_share_exactly_the_system_prompt() -> None:
    w = shared_prefix_workload(POOL, num_requests=10, system_prompt_tokens=64)
    prompts = [r.prompt_token_ids for r in w.requests]
    assert all(p[:64] == prompts[0][:64] for p in prompts)
    assert len({p[64:] for p in prompts}) == 10
    assert w.params["system_prompt_tokens"] == 64


def test_summary_totals_and_make_workload_errors() -> None:
    w = make_workload("seed", POOL, num_requests=5, new_tokens_scale=0.5)
    s = w.summary()
    assert s["num_requests"] == 5
    assert s["max_tokens"]["total"] == w.output_tokens == sum(r.max_tokens for r in w.requests)
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("nope", POOL)
    with pytest.raises(ValueError, match="num_requests"):
        make_workload("seed", POOL, num_requests=0)


def test_shared_prefix_warmup_shares_the_system_prompt_but_is_not_timed() -> None:
    w = shared_prefix_workload(POOL, num_requests=4, system_prompt_tokens=32)
    assert len(w.warmup) == 1
    assert w.warmup[0].prompt_token_ids[:32] == w.requests[0].prompt_token_ids[:32]
    assert w.warmup[0] not in w.requests
    assert w.summary()["warmup_requests"] == 1
