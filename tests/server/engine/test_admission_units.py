"""Admission in units that can always finish (issue 28).

- A beam search's beams are admitted, preempted and readmitted together:
  several beam searches on a small pool used to each hold beam 0 while
  their other beams waited for blocks, forever.
- A preempted sequence of a hybrid (sliding + full) model comes back
  reserving its prompt and then one chunk at a time, so its sliding groups
  hold a window, not its whole history: it used to need more blocks than
  the pool had and waited forever.
- Progress guarantee: a queue head that cannot be allocated with nothing
  running fails with a message naming why, instead of waiting forever."""

from __future__ import annotations

import logging

from paged_server import LLM
from paged_server.sampling_params import BeamSearchParams, SamplingParams

MAX_STEPS = 2000  # each run here needs a few hundred at most; a stall fails, not hangs


def step_limit(engine, limit: int = MAX_STEPS) -> None:
    """Make ``engine.step`` fail once it was called ``limit`` times."""
    step, calls = engine.step, [0]

    def limited():
        calls[0] += 1
        assert calls[0] <= limit, f"no progress after {limit} steps: {stuck(engine)}"
        return step()

    engine.step = limited


def stuck(engine) -> str:
    s = engine.scheduler
    return (f"running {[(q.request.request_id, q.index) for q in s.running]}, waiting "
            f"{[(q.request.request_id, q.index) for q in s.waiting]}, "
            f"{engine.kv_manager.free_token_capacity()} tokens free")


def split_beam_searches(engine) -> list[str]:
    """Forked beam searches some of whose beams hold KV while others wait."""
    split = []
    for request in {id(s.request): s.request for s in engine.scheduler.running}.values():
        if request.beam is None or not request.forked:
            continue
        held = [s.pool_seq_id is not None for s in request.seqs if not s.is_finished]
        if any(held) and not all(held):
            split.append(f"{request.request_id}: {held}")
    return split


def test_beam_searches_on_a_small_pool_all_finish(tiny_loaded, prompt_of) -> None:
    prompts = [prompt_of(10, seed) for seed in range(6)]
    params = BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True)
    cfg = dict(max_batch_size=32, max_model_len=128, block_size=4, device="cpu",
               attention_backend="ref", enable_prefix_caching=False)
    # 4 beams x 8 blocks fit 32 alone; six searches at once did not (issue 28: deadlock).
    tight = LLM(loaded=tiny_loaded, num_gpu_blocks=32, **cfg)
    step_limit(tight.engine)
    step, split = tight.engine.step, []

    def checked():
        out = step()
        split.extend(split_beam_searches(tight.engine))
        return out

    tight.engine.step = checked
    results = tight.beam_search(prompts, params)
    assert split == [], "a beam held KV while a sibling waited"
    assert tight.engine.metrics()["num_preemptions_total"] > 0, "the pool was never short"
    assert tight.engine.audit() == []
    assert tight.engine.metrics()["kv_cache_usage_perc"] == 0.0
    roomy = LLM(loaded=tiny_loaded, num_gpu_blocks=512, **cfg).beam_search(prompts, params)
    for got, want in zip(results, roomy, strict=True):
        assert [b.error for b in got.sequences] == [None] * 4
        assert [b.tokens for b in got.sequences] == [b.tokens for b in want.sequences]


def test_preempted_fork_of_a_hybrid_model_comes_back(tiny_hybrid_loaded, prompt_of) -> None:
    # 1 full + 3 sliding groups (window 8, blocks of 4). Three choices of
    # 12 + 40 tokens outgrow 30 blocks, so forks are preempted at up to ~50
    # tokens: their whole history in all four groups would take ~50 blocks.
    cfg = dict(max_batch_size=4, max_model_len=128, block_size=4, device="cpu",
               attention_backend="ref", max_num_batched_tokens=64)
    prompt = prompt_of(12, 3)
    params = SamplingParams(n=3, max_tokens=40, temperature=0.0, ignore_eos=True)
    tight = LLM(loaded=tiny_hybrid_loaded, num_gpu_blocks=31, **cfg)
    assert tight.engine.capacity.num_groups == 4
    step_limit(tight.engine)
    (result,) = tight.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    assert tight.engine.metrics()["num_preemptions_total"] > 0, "no fork was preempted"
    assert tight.engine.audit() == []
    assert tight.engine.metrics()["kv_cache_usage_perc"] == 0.0
    roomy = LLM(loaded=tiny_hybrid_loaded, num_gpu_blocks=400, **cfg)
    (want,) = roomy.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    assert [c.finish_reason for c in result.outputs] == ["length"] * 3
    assert [c.token_ids for c in result.outputs] == [c.token_ids for c in want.outputs]


def test_a_head_that_can_never_be_allocated_fails_with_the_reason(make_engine, run_engine,
                                                                   prompt_of, greedy) -> None:
    engine = make_engine(num_gpu_blocks=8)
    engine.kv_manager.allocate_sequence(prompt_of(12, 1))  # 3 blocks nobody will free (a leak)
    run = run_engine(engine, [("big", prompt_of(20, 2), greedy(max_tokens=8))], max_steps=50)
    choice = run.choices[("big", 0)]
    assert choice.finish_reason == "error"
    assert "can never be scheduled" in choice.error and "nothing else running" in choice.error
    assert "'big'" in choice.error and "num_gpu_blocks" in choice.error
    assert not engine.has_unfinished()  # an idle server's engine thread waits, it does not spin
    # The next request that fits is served.
    run = run_engine(engine, [("small", prompt_of(6, 3), greedy(max_tokens=4))], max_steps=50)
    assert run.choices[("small", 0)].finish_reason == "length"


def test_the_refusal_is_logged(make_engine, prompt_of, greedy, caplog) -> None:
    engine = make_engine(num_gpu_blocks=8)
    engine.kv_manager.allocate_sequence(prompt_of(12, 1))
    engine.add_request("big", prompt_of(20, 2), greedy(max_tokens=8))
    with caplog.at_level(logging.ERROR, logger="paged_server.engine.core.llm_engine"):
        for _ in range(3):
            engine.step()
    assert any("'big' can never be scheduled" in r.getMessage() for r in caplog.records)


def test_beams_left_without_budget_compute_next_step(make_engine, run_engine, prompt_of,
                                                     greedy) -> None:
    """Issue 53: a preempted beam search comes back as one unit, and when
    its first beam's recompute took what was left of the step's token
    budget, the next beam's chunk was cut from a budget of 0
    (``ZeroDivisionError`` in ``Scheduler._chunk``): the step raised and
    every request in flight failed. A beam left without budget computes
    next step."""
    beams = BeamSearchParams(beam_width=2, max_tokens=12, ignore_eos=True).to_sampling_params()
    requests = []
    for i in range(3):
        requests += [(f"beam{i}", prompt_of(7, i), beams), (f"plain{i}", prompt_of(7, 50 + i), greedy())]
    cfg = dict(max_model_len=64, max_num_batched_tokens=16, enable_prefix_caching=False)
    tight = make_engine(num_gpu_blocks=16, **cfg)
    run = run_engine(tight, requests, max_steps=500)
    assert tight.metrics()["num_preemptions_total"] > 0, "no beam search was preempted"
    assert tight.audit() == []
    want = run_engine(make_engine(num_gpu_blocks=256, **cfg), requests)
    assert run.choices.keys() == want.choices.keys()
    for key, choice in run.choices.items():
        assert (choice.finish_reason, choice.error) == ("length", None), key
        assert choice.token_ids == want.choices[key].token_ids, key
