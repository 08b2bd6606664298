"""Priority scheduling through the engine (vLLM's ``--scheduling-policy
priority`` and a request's ``priority``): with one running place, a
priority-0 request submitted last finishes before the priority-10 ones; a
higher-priority request that finds the KV cache full preempts a running
lower-priority one, which still ends with the greedy tokens it has alone;
under fcfs a nonzero priority is refused, as vLLM refuses it."""

from __future__ import annotations

import logging

import pytest

from paged_server.entrypoints.llm import LLM


def finish_order(engine, submit_at: dict[int, list[tuple[str, list[int], object, int]]]) -> tuple[
        list[str], dict[str, list[int]]]:  # fmt: skip
    """Step ``engine`` to idle, submitting ``(id, prompt, params, priority)``
    at the steps named; returns the ids in the order they finished and each
    one's tokens."""
    order: list[str] = []
    tokens: dict[str, list[int]] = {}
    step = 0
    while step <= max(submit_at) or engine.has_unfinished():
        for request_id, prompt, params, priority in submit_at.get(step, []):
            engine.add_request(request_id, prompt, params, priority=priority)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason == "length", (out.request_id, out.error)
                order.append(out.request_id)
        step += 1
        assert step < 500, "stalled"
    assert engine.audit() == []
    return order, tokens


def test_a_priority_0_request_submitted_last_finishes_before_the_priority_10_ones(
    make_engine, greedy, prompt_of, caplog
) -> None:
    """One running place: ``low0`` runs, ``low1`` and ``low2`` wait (10),
    then ``urgent`` (0) arrives. It preempts ``low0`` and finishes first;
    the priority-10 ones then finish in arrival order, ``low0`` (recomputed)
    with the tokens it has alone. Under fcfs ``urgent`` finishes last."""
    params = greedy(8)
    lows = [(f"low{i}", prompt_of(6, i), params, 10) for i in range(3)]
    urgent = ("urgent", prompt_of(5, 9), params, 0)
    engine = make_engine(max_batch_size=1, scheduling_policy="priority")
    with caplog.at_level(logging.WARNING, logger="paged_server.engine.core.llm_engine"):
        order, tokens = finish_order(engine, {0: lows, 2: [urgent]})
    assert order == ["urgent", "low0", "low1", "low2"]
    assert engine.counters.preemptions == 1
    [line] = [r.getMessage() for r in caplog.records if "preempted sequence" in r.getMessage()]
    assert "(request low0, priority 10)" in line and "a higher-priority request waiting" in line
    _, alone_tokens = finish_order(make_engine(max_batch_size=1), {0: [(rid, p, params, 0) for rid, p, params, _ in lows]})
    assert tokens["low0"] == alone_tokens["low0"]
    fcfs = make_engine(max_batch_size=1)
    order, _ = finish_order(fcfs, {0: [(*r[:3], 0) for r in lows], 2: [(*urgent[:3], 0)]})
    assert order == ["low0", "low1", "low2", "urgent"]


def test_a_full_kv_cache_preempts_the_lower_priority_request_which_still_finishes(
    make_engine, greedy, prompt_of
) -> None:
    """Ten blocks of 4 tokens: ``low`` (priority 5, 20 + 16 tokens) holds most
    of them when ``high`` (1, 16 + 4 tokens) arrives; the two never fit
    together. ``high`` preempts ``low`` and finishes first; ``low`` is
    recomputed and ends with its greedy tokens alone. Under fcfs, same
    traffic: ``low`` finishes first and nothing is preempted."""
    low = ("low", prompt_of(20, 1), greedy(16), 5)
    high = ("high", prompt_of(16, 2), greedy(4), 1)
    engine = make_engine(num_gpu_blocks=10, scheduling_policy="priority")
    order, tokens = finish_order(engine, {0: [low], 4: [high]})
    assert order == ["high", "low"] and engine.counters.preemptions >= 1
    _, alone = finish_order(make_engine(num_gpu_blocks=10), {0: [(*low[:3], 0)]})
    assert tokens["low"] == alone["low"] and len(alone["low"]) == 16
    fcfs = make_engine(num_gpu_blocks=10)
    order, _ = finish_order(fcfs, {0: [(*low[:3], 0)], 4: [(*high[:3], 0)]})
    assert order == ["low", "high"] and fcfs.counters.preemptions == 0


def test_fcfs_refuses_a_nonzero_priority(make_engine, greedy, prompt_of) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match=r"^priority: got 3 but priority scheduling is not enabled "
                       r".*--scheduling-policy priority, or send 0$"):  # fmt: skip
        engine.add_request("r", prompt_of(4, 0), greedy(2), priority=3)
    with pytest.raises(ValueError, match=r"^priority: must be an integer, got 1.5"):
        make_engine(scheduling_policy="priority").add_request("r", prompt_of(4, 0), greedy(2), priority=1.5)
    engine.add_request("r", prompt_of(4, 0), greedy(2), priority=0)  # vLLM's default: accepted


def test_offline_generate_takes_one_priority_per_prompt(tiny_loaded, greedy, prompt_of) -> None:
    """``LLM.generate(..., priority=[...])`` as vLLM's: under fcfs a nonzero
    one is refused before anything runs; a list of the wrong length too; under
    priority the results are each prompt's own, in prompt order."""
    prompts = [prompt_of(5, i) for i in range(3)]
    with LLM(loaded=tiny_loaded, max_batch_size=1, max_model_len=64, block_size=4) as llm:
        with pytest.raises(ValueError, match="priority: got 2 but priority scheduling is not enabled"):
            llm.generate(prompt_token_ids=prompts, sampling_params=greedy(4), priority=[0, 2, 0])
        assert llm.engine.has_unfinished() is False
        expected = [r.outputs[0].token_ids for r in llm.generate(prompt_token_ids=prompts,
                                                                 sampling_params=greedy(4))]
    with LLM(loaded=tiny_loaded, max_batch_size=1, max_model_len=64, block_size=4,
             scheduling_policy="priority") as llm:
        with pytest.raises(ValueError, match="priority: 2 given for 3 prompts"):
            llm.generate(prompt_token_ids=prompts, sampling_params=greedy(4), priority=[1, 2])
        finished: list[str] = []
        step = llm.engine.step

        def recording_step():  # the engine's own stream: which request ends when
            outs = step()
            finished.extend(o.request_id for o in outs if o.finished)
            return outs

        llm.engine.step = recording_step
        results = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(4), priority=[9, 0, 5])
    assert [r.outputs[0].token_ids for r in results] == expected
    by_prompt = [r.request_id for r in results]
    assert finished == [by_prompt[1], by_prompt[2], by_prompt[0]]  # priority 0, 5, then 9
