"""Property: whatever the traffic and however small the pool, every request
ends within a bounded number of steps (issues 28 and 53).

The real engine (tiny Llama; tiny Gemma 3s with every layer sliding, and
with sliding and full layers, a hybrid paged pool; the contiguous pool too;
reference attention) runs random mixes of plain requests, ``n > 1``, beam
search, prompts sharing a prefix (prefix hits), requests arriving mid-run,
aborts, chunked prefill on or off, step budgets that beams and choices
exhaust, and pools from none to plenty, most barely above one request;
fcfs, or priority scheduling with random priorities (a request of a higher
one preempting lower ones for room, never a peer).
Half the engines start as a compiled CPU engine does, warm-up included
(``torch.compile`` itself left out: it costs seconds per engine). An engine
refuses to start only when its pool holds no request at all, in one line.
Each request is either refused at submission with a ``ValueError`` or
finishes (``length``, ``stop`` or ``abort``: never an error, never a stall).
The audit is clean after every step and the KV cache is empty at the end.

The explicit examples are the shapes that failed: beam searches sharing a
small pool (each held beam 0 while its other beams waited), a preempted
``n > 1`` fork of the hybrid model (it needed its whole history in every KV
cache group to come back), beams readmitted with the step's budget spent
(``ZeroDivisionError``: the step failed every request), and compiled
start-ups on small pools (the warm-up's throwaway prefill did not fit)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from paged_server.config import EngineConfig
from paged_server.engine.core.llm_engine import LLMEngine
from paged_server.sampling_params import BeamSearchParams, SamplingParams

PREFIX_LEN = 8  # two blocks of 4: a later prompt with the same prefix hits them
MAX_STEPS = 1000  # each example needs well under 200
# KV cache groups and null blocks (a pool with sliding layers keeps one) per model
GROUPS = {"llama": (1, 0), "sliding": (1, 1), "hybrid": (4, 1)}

requests = st.lists(
    st.fixed_dictionaries({
        "kind": st.sampled_from(["plain", "n", "beam"]),
        "width": st.integers(2, 4),  # n, or beam_width
        "prefix": st.sampled_from([None, 0, 1]),
        "tail": st.integers(1, 10),
        "max_tokens": st.integers(1, 10),
        "arrive": st.integers(0, 6),  # step at which it is submitted
        "abort": st.one_of(st.none(), st.integers(0, 12)),  # step at which it is aborted
        "priority": st.integers(-1, 2),  # read under the priority policy only
    }),
    min_size=1,
    max_size=5,
)
scenarios = st.fixed_dictionaries({
    "model": st.sampled_from(["llama", "sliding", "hybrid"]),
    "kv_cache_backend": st.sampled_from(["paged", "paged", "contiguous"]),
    # blocks past the fewest that hold one request (may be negative: none then)
    "spare_blocks": st.one_of(st.integers(-2, 4), st.integers(5, 36)),
    "max_batch_size": st.integers(3, 6),
    # the step's token budget: at least max_batch_size (and, without chunked
    # prefill, max_model_len more: whole prompts), config refuses less
    "max_num_batched_tokens": st.integers(0, 44),
    "enable_chunked_prefill": st.booleans(),
    "enable_prefix_caching": st.booleans(),
    "compiled": st.booleans(),
    "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
    "requests": requests,
})

# Two searches of 2 beams x 5 blocks on 10 blocks: each held beam 0, waiting for beam 1.
BEAMS_SHARING_A_SMALL_POOL = {
    "model": "llama", "kv_cache_backend": "paged", "spare_blocks": 9, "max_batch_size": 6,
    "max_num_batched_tokens": 42, "enable_chunked_prefill": True, "enable_prefix_caching": False,
    "compiled": False, "requests": [
        {"kind": "beam", "width": 2, "prefix": None, "tail": 8, "max_tokens": 10, "arrive": 0,
         "abort": None}
        for _ in range(2)
    ],
}  # fmt: skip
# Three choices of 12 + 40 tokens on 30 blocks (1 full + 3 sliding groups):
# a fork preempted late needed its whole history in all four groups to return.
HYBRID_FORKS_PREEMPTED = {
    "model": "hybrid", "kv_cache_backend": "paged", "spare_blocks": 26, "max_batch_size": 4,
    "max_num_batched_tokens": 60, "enable_chunked_prefill": True, "enable_prefix_caching": False,
    "compiled": False, "requests": [
        {"kind": "n", "width": 3, "prefix": 0, "tail": 4, "max_tokens": 40, "arrive": 0,
         "abort": None},
    ],
}  # fmt: skip
# Searches of 2 beams beside greedy requests on 16 blocks and a 16-token budget:
# a preempted search came back, its first beam's recompute took the rest of
# the budget, and the second beam's chunk was cut from 0 tokens (ZeroDivisionError).
BEAMS_PAST_THE_BUDGET = {
    "model": "llama", "kv_cache_backend": "paged", "spare_blocks": 15, "max_batch_size": 8,
    "max_num_batched_tokens": 8, "enable_chunked_prefill": True, "enable_prefix_caching": False,
    "compiled": False, "requests": [
        {"kind": kind, "width": 2, "prefix": None, "tail": 7, "max_tokens": 10, "arrive": 0,
         "abort": None}
        for _ in range(3) for kind in ("beam", "plain")
    ],
}  # fmt: skip
# A compiled start-up on 5 blocks of the all-sliding model (4 and the null
# block): the warm-up's throwaway prefill of 47 tokens needed 12.
SLIDING_FIVE_BLOCKS = {
    "model": "sliding", "kv_cache_backend": "paged", "spare_blocks": 3, "max_batch_size": 3,
    "max_num_batched_tokens": 44, "enable_chunked_prefill": True, "enable_prefix_caching": True,
    "compiled": True, "requests": [
        {"kind": "n", "width": 2, "prefix": None, "tail": 10, "max_tokens": 10, "arrive": 0,
         "abort": None},
    ],
}  # fmt: skip


# Priority scheduling: a beam search (priority 2) and a peer holding a small
# pool (or all 3 running places) when a priority -1 request and then an n=2
# one (0) arrive: each preempts what is below it, and everything still ends.
PRIORITIES_PREEMPTING_BEAMS = {
    "model": "llama", "kv_cache_backend": "paged", "spare_blocks": 8, "max_batch_size": 4,
    "max_num_batched_tokens": 20, "enable_chunked_prefill": True, "enable_prefix_caching": True,
    "compiled": False, "scheduling_policy": "priority", "requests": [
        {"kind": kind, "width": 2, "prefix": 0, "tail": 6, "max_tokens": 10, "arrive": arrive,
         "abort": None, "priority": priority}
        for kind, arrive, priority in (("beam", 0, 2), ("plain", 1, 2), ("plain", 2, -1), ("n", 3, 0))
    ],
}  # fmt: skip
PRIORITIES_IN_FEW_PLACES = {**PRIORITIES_PREEMPTING_BEAMS, "spare_blocks": 30, "max_batch_size": 3}


def prompt(spec: dict[str, Any], i: int, prompt_of) -> list[int]:
    tail = prompt_of(spec["tail"], 100 + i)
    return tail if spec["prefix"] is None else prompt_of(PREFIX_LEN, spec["prefix"]) + tail


def params(spec: dict[str, Any], i: int) -> SamplingParams:
    if spec["kind"] == "beam":
        beam = BeamSearchParams(beam_width=spec["width"], max_tokens=spec["max_tokens"],
                                ignore_eos=True)
        return beam.to_sampling_params()
    n = spec["width"] if spec["kind"] == "n" else 1
    return SamplingParams(n=n, max_tokens=spec["max_tokens"], temperature=1.0, seed=i)


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(scenario=scenarios)
@example(scenario=BEAMS_SHARING_A_SMALL_POOL)
@example(scenario=HYBRID_FORKS_PREEMPTED)
@example(scenario=BEAMS_PAST_THE_BUDGET)
@example(scenario=SLIDING_FIVE_BLOCKS)
@example(scenario=PRIORITIES_PREEMPTING_BEAMS)
@example(scenario=PRIORITIES_IN_FEW_PLACES)
def test_every_request_ends_within_bounded_steps(request, prompt_of, monkeypatch,
                                                 scenario) -> None:
    scenario = dict(scenario)
    specs = scenario.pop("requests")
    model = scenario.pop("model")
    loaded = request.getfixturevalue(f"tiny_{model}_loaded" if model != "llama" else "tiny_loaded")
    groups, null = GROUPS[model]
    # past the fewest blocks that hold one request (a one-token prompt, one generated token)
    num_gpu_blocks = max(groups + null + scenario.pop("spare_blocks"), 1)
    budget = scenario.pop("max_num_batched_tokens") + scenario["max_batch_size"]
    if not scenario["enable_chunked_prefill"]:
        budget += 64  # whole prompts, up to max_model_len
    # a compiled CPU engine's start-up and steps (warm-up, padded rows), torch.compile aside
    monkeypatch.setenv("PAGED_COMPILE", "1" if scenario.pop("compiled") else "0")
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    by_priority = scenario.setdefault("scheduling_policy", "fcfs") == "priority"
    config = EngineConfig(max_model_len=64, block_size=4, device="cpu", attention_backend="ref",
                          num_gpu_blocks=num_gpu_blocks, max_num_batched_tokens=budget,
                          **scenario)  # fmt: skip
    if num_gpu_blocks < groups + null and scenario["kv_cache_backend"] == "paged":
        with pytest.raises(ValueError, match="hold no request") as refused:
            LLMEngine(config, loaded)
        assert "\n" not in str(refused.value)
        return
    engine = LLMEngine(config, loaded)  # any pool that holds one request starts
    accepted: dict[str, int] = {}  # request id -> choices it reports
    ended: dict[tuple[str, int], str] = {}
    step = 0
    while step <= max(s["arrive"] for s in specs) or engine.has_unfinished():
        for i, spec in enumerate(specs):
            rid = f"r{i}"
            if spec["arrive"] == step:
                p = params(spec, i)
                try:
                    engine.add_request(rid, prompt(spec, i, prompt_of), p,
                                       priority=spec.get("priority", 0) if by_priority else 0)
                except ValueError:
                    continue  # could never fit this pool: refused at submission
                accepted[rid] = p.n
            if spec["abort"] == step and rid in accepted:
                engine.abort_request(rid)
        for out in engine.step():
            if out.finished:
                ended[(out.request_id, out.index)] = out.finish_reason
                assert out.finish_reason != "error", (out.request_id, out.error)
        assert engine.audit() == []
        assert engine.scheduler.num_running_places() <= config.max_batch_size
        step += 1
        assert step <= MAX_STEPS, f"stalled: {len(ended)} choices ended of {sum(accepted.values())}"
    for rid, n in accepted.items():
        for index in range(n):
            assert ended.get((rid, index)) in ("length", "stop", "abort"), (rid, index)
    assert engine.audit() == []  # idle: any KV still held is reported as a leak
    assert engine.metrics()["kv_cache_usage_perc"] == 0.0
