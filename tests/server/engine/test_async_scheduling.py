"""``async_scheduling`` (vLLM's ``--async-scheduling``): step N+1 is planned
while step N's pass runs on the launch thread, and N's tokens are appended,
checked and turned into outputs while N+1's runs. What a client receives
must not change: the same tokens, text, logprobs and finish reasons as the
synchronous engine, for every kind of request whose end or text depends on
its tokens, under preemption, chunked prefill and aborts; and the host work
must really sit beside the pass."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from paged_server.config import EngineConfig
from paged_server.sampling_params import SamplingParams, StructuredOutputsParams

_JSON = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})


def _requests(prompt_of, greedy, stop: str, stop_token: int) -> list:
    return [
        ("plain", prompt_of(9, 1), greedy(12)),
        ("stop_string", prompt_of(9, 1), greedy(12, stop=[stop])),
        ("stop_string_kept", prompt_of(9, 1), greedy(12, stop=[stop], include_stop_str_in_output=True)),
        ("stop_token", prompt_of(9, 1), greedy(12, stop_token_ids=[stop_token])),
        ("sampled_n2", prompt_of(7, 2), SamplingParams(n=2, max_tokens=10, seed=5, ignore_eos=True)),
        ("logprobs", prompt_of(8, 3), greedy(6, logprobs=2)),
        ("prompt_logprobs", prompt_of(30, 8), greedy(5, prompt_logprobs=1)),
        ("until_eos", prompt_of(6, 4), SamplingParams(max_tokens=60, seed=7, temperature=1.5)),
        ("penalties", prompt_of(6, 9), SamplingParams(max_tokens=20, seed=3, repetition_penalty=1.3,
                                                     frequency_penalty=0.5, ignore_eos=True)),
        ("json", prompt_of(5, 5), SamplingParams(max_tokens=24, structured_outputs=_JSON)),
        ("beams", prompt_of(9, 6), SamplingParams(n=2, best_of=2, use_beam_search=True, max_tokens=6)),
        ("long_prompt", prompt_of(70, 10), greedy(8)),  # chunked: the budget below is 32 tokens
        ("no_text", prompt_of(9, 7), greedy(5, detokenize=False)),
        ("grows_a", prompt_of(9, 11), greedy(50)),  # the two of them outgrow a small pool
        ("grows_b", prompt_of(9, 12), greedy(50)),
    ]  # fmt: skip


def _same(run, ref) -> None:
    assert run.choices.keys() == ref.choices.keys()
    for key, choice in ref.choices.items():
        got = run.choices[key]
        assert (got.token_ids, got.text) == (choice.token_ids, choice.text), key
        assert (got.finish_reason, got.error) == (choice.finish_reason, choice.error), key
        # Steps hold other sequences side by side (the next is planned earlier),
        # so a logprob may differ in its last float32 bits, never more.
        assert got.logprobs == pytest.approx(choice.logprobs, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize(
    "pool",
    [
        dict(num_gpu_blocks=24),  # two or three of these requests at once: preemption and recompute
        dict(kv_cache_backend="contiguous", max_batch_size=4),
    ],
)
def test_async_scheduling_streams_what_the_synchronous_engine_does(
    make_engine, run_engine, prompt_of, greedy, pool
) -> None:
    probe = run_engine(make_engine(), [("plain", prompt_of(9, 1), greedy(12))])
    plain = probe.choices[("plain", 0)]
    stop = plain.text[len(plain.text) // 2 :][:2]  # a stop string some tokens in
    assert stop and plain.text.index(stop) > 0, plain.text
    requests = _requests(prompt_of, greedy, stop, plain.token_ids[5])
    config = dict(max_num_batched_tokens=32, **pool)
    ref_engine, engine = make_engine(**config), make_engine(async_scheduling=True, **config)
    ref = run_engine(ref_engine, requests)
    run = run_engine(engine, requests)
    _same(run, ref)
    assert ref.choices[("stop_string", 0)].finish_reason == "stop"
    assert len(ref.tokens("stop_string")) < len(ref.tokens("plain"))
    if "num_gpu_blocks" in pool:  # the workload did preempt, with steps in flight
        assert engine.metrics()["num_preemptions_total"] > 0
    assert (
        engine.metrics()["generation_tokens_total"]
        == ref_engine.metrics()["generation_tokens_total"]
    )
    assert engine.audit() == [] and ref_engine.audit() == []
    assert engine.metrics()["kv_cache_usage_perc"] == 0.0
    engine.shutdown()


@pytest.mark.parametrize("at_step", [1, 2, 3, 5])
def test_an_abort_with_a_step_in_flight_ends_the_request_cleanly(
    make_engine, run_engine, prompt_of, greedy, at_step
) -> None:
    ref = run_engine(make_engine(), [("stays", prompt_of(7, 2), greedy(6))])
    engine = make_engine(async_scheduling=True)

    def abort(step: int, eng) -> None:
        if step == at_step:
            eng.abort_request("gone")

    run = run_engine(
        engine,
        [("gone", prompt_of(9, 1), greedy(12)), ("stays", prompt_of(7, 2), greedy(6))],
        on_step=abort,
    )
    assert run.choices[("gone", 0)].finish_reason == "abort"
    assert run.tokens("stays") == ref.tokens("stays")
    assert engine.audit() == [] and engine.metrics()["kv_cache_usage_perc"] == 0.0


def test_a_pass_that_fails_in_flight_fails_its_requests_only(
    make_engine, run_engine, prompt_of, greedy
) -> None:
    engine = make_engine(async_scheduling=True)
    real, calls = engine.worker.execute, {"n": 0}

    def flaky(step, meta=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device error")
        return real(step, meta)

    engine.worker.execute = flaky  # type: ignore[method-assign]
    run = run_engine(engine, [("a", prompt_of(6, 0), greedy(6)), ("b", prompt_of(6, 1), greedy(6))])
    assert {c.finish_reason for c in run.choices.values()} == {"error"}
    assert "simulated device error" in (run.choices[("a", 0)].error or "")
    assert engine.audit() == []
    again = run_engine(engine, [("c", prompt_of(6, 2), greedy(6))])
    assert again.choices[("c", 0)].finish_reason == "length"
    assert engine.audit() == [] and engine.metrics()["kv_cache_usage_perc"] == 0.0


def test_the_host_work_of_a_step_runs_while_the_next_pass_does(
    make_engine, run_engine, prompt_of, greedy
) -> None:
    """A pass made to take 30 ms: it runs on the launch thread, never the
    engine's, and step N's tokens are appended while pass N+1 is still
    running (launched, not done)."""
    engine = make_engine(async_scheduling=True)
    real = engine.worker.execute
    threads: set[str] = set()
    seen: list[bool] = []

    def slow(step, meta=None):
        threads.add(threading.current_thread().name)
        time.sleep(0.03)
        return real(step, meta)

    engine.worker.execute = slow  # type: ignore[method-assign]
    accept = engine._accept

    def watched(drawn):
        inflight = engine._inflight
        seen.append(inflight is not None and not inflight.future.done())
        return accept(drawn)

    engine._accept = watched  # type: ignore[method-assign]
    run = run_engine(engine, [(f"r{i}", prompt_of(5, i), greedy(10)) for i in range(4)])
    assert all(c.finish_reason == "length" for c in run.choices.values())
    assert threading.current_thread().name not in threads and len(threads) == 1
    # Every step's tokens but the last one's were appended beside the next pass.
    assert len(seen) >= 10 and sum(seen) >= len(seen) - 1, seen


def test_the_default_is_on_with_cuda_and_off_on_a_cpu(tiny_loaded) -> None:
    mc = tiny_loaded.config
    assert EngineConfig().resolve(mc, torch.device("cpu"), torch.float32).async_scheduling is False
    assert EngineConfig().resolve(mc, torch.device("cuda"), torch.bfloat16).async_scheduling is True
    off = EngineConfig(async_scheduling=False).resolve(mc, torch.device("cuda"), torch.bfloat16)
    assert off.async_scheduling is False
