"""Counters in one place, preemptions logged, audits counted, leaks reclaimed.

Prefix-cache numbers come from the pool's block manager only (the engine
used to count hits a second time); preemptions from the scheduler's plan
only. A request's cached tokens are its first admission's prefix hits."""

from __future__ import annotations

import logging

from paged_server.sampling_params import SamplingParams


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def finals(engine, request_id, prompt, params):
    """Run one request alone; its final outputs (one per choice)."""
    engine.add_request(request_id, prompt, params)
    out = []
    while engine.has_unfinished():
        out += [o for o in engine.step() if o.finished]
    return out


def test_prefix_hits_are_counted_once_from_the_pool(make_engine, prompt_of) -> None:
    engine = make_engine(num_gpu_blocks=64)  # block_size 4
    prompt = prompt_of(13, 0)  # 3 matchable blocks + the block of the last token
    (first,) = finals(engine, "a", prompt, greedy(2))
    (second,) = finals(engine, "b", prompt, greedy(2))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 12)
    m, stats = engine.metrics(), engine.kv_manager.stats()
    assert m["prefix_cache_hits_total"] == stats["prefix_hits_tokens"] == 12
    assert m["prefix_cache_queries_total"] == stats["prefix_queries_tokens"] == 26
    misses = sum(m[f"prefix_cache_misses_{r}_total"] for r in ("too_short", "evicted", "never_seen"))
    assert m["prefix_cache_queries_total"] == m["prefix_cache_hits_total"] + misses
    assert m["prefix_cache_misses_too_short_total"] == 2  # token 13 of each prompt
    assert m["prefix_cache_misses_never_seen_total"] == 12


def test_n_choices_report_the_requests_hits(make_engine, prompt_of) -> None:
    engine = make_engine(num_gpu_blocks=64)
    prompt = prompt_of(9, 1)
    finals(engine, "warm", prompt, greedy(1))
    params = SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=1, ignore_eos=True)
    outs = finals(engine, "n3", prompt, params)
    assert sorted(o.num_cached_tokens for o in outs) == [8, 8, 8]
    assert all(o.first_scheduled_time >= o.arrival_time for o in outs)


def test_preemptions_are_counted_once_and_logged_rate_limited(
    make_engine, run_engine, prompt_of, caplog
) -> None:
    engine = make_engine(num_gpu_blocks=7)  # 28 tokens for three 20-token sequences
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    requests = [(f"r{i}", prompt_of(6, i), params) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="paged_server.engine.core.llm_engine"):
        run_engine(engine, requests)
    preemptions = engine.metrics()["num_preemptions_total"]
    assert preemptions >= 2
    lines = [r.getMessage() for r in caplog.records if "preempted sequence" in r.getMessage()]
    assert len(lines) == 1  # the rest fall within the rate limit
    assert "tokens: KV cache full" in lines[0] and "free blocks" in lines[0]
    assert engine.kv_manager.stats().get("preemptions") is None  # the block manager keeps none
    assert engine.audit() == []


def test_audits_are_counted_and_findings_exported(make_engine) -> None:
    engine = make_engine(num_gpu_blocks=16)
    assert engine.audit() == []
    m = engine.metrics()
    assert (m["kv_audits_total"], m["kv_audit_problems"]) == (1, 0)
    leaked = engine.kv_manager.block_manager.block_pool.get_new_blocks(2)  # a bug's leak
    problems = engine.audit()
    assert problems and engine.metrics()["kv_audit_problems"] == len(problems)
    assert sorted(engine.reclaim_leaked()) == sorted(b.block_id for b in leaked)
    assert engine.audit() == [] and engine.metrics()["kv_audit_problems"] == 0
    assert engine.reclaim_leaked() == []


def test_contiguous_pool_has_nothing_to_reclaim(make_engine) -> None:
    engine = make_engine(kv_cache_backend="contiguous")
    assert engine.reclaim_leaked() == []
    assert engine.metrics()["prefix_cache_queries_total"] == 0
