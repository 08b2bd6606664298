"""Prefix caching computes a shared prompt prefix once; n > 1 choices share
their prompt's blocks (copy-on-write) and sample independently; seeds make
sampling reproducible whatever else is in the batch."""

from __future__ import annotations

import pytest

from paged_server.sampling_params import SamplingParams


def count_prefill_tokens(engine) -> list[int]:
    """Wrap the runner so the test sees every prompt token it computes."""
    seen: list[int] = []
    real = engine._forward

    def counting(scheduled):
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            seen.append(max(0, min(start + n, seq.num_prompt_tokens) - start))
        return real(scheduled)

    engine._forward = counting
    return seen


def shared_prefix_requests(prompt_of, greedy):
    system = prompt_of(16, 1000)  # 4 blocks of 4
    return [(f"u{i}", system + prompt_of(3 + i % 4, i), greedy(6)) for i in range(16)]


def test_shared_system_prompt_is_computed_once(make_engine, run_engine, prompt_of, greedy) -> None:
    requests = shared_prefix_requests(prompt_of, greedy)
    engine = make_engine(max_batch_size=16)
    computed = count_prefill_tokens(engine)
    engine.add_request(*requests[0])
    first_outputs = engine.step()
    run = run_engine(engine, requests[1:], resumed=True)

    total_prompt = sum(len(p) for _, p, _ in requests)
    m = engine.metrics()
    assert m["prefix_cache_hits_total"] == 15 * 16
    assert m["prefix_cache_queries_total"] == total_prompt
    assert sum(computed) == total_prompt - 15 * 16  # the system prompt once, suffixes each

    off = make_engine(max_batch_size=16, enable_prefix_caching=False)
    ref = run_engine(off, requests)
    assert off.metrics()["prefix_cache_hits_total"] == 0
    assert first_outputs[0].new_token_ids == ref.tokens("u0")[:1]
    for request_id, _, _ in requests[1:]:
        assert run.tokens(request_id) == ref.tokens(request_id)
    assert engine.audit() == [] and off.audit() == []


def test_prefix_hit_on_whole_prompt_still_computes_its_last_token(
    make_engine, run_engine, prompt_of, greedy
) -> None:
    prompt = prompt_of(12, 5)  # exactly 3 blocks
    engine = make_engine()
    first = run_engine(engine, [("a", prompt, greedy(5))])
    second = run_engine(engine, [("b", prompt, greedy(5))])
    assert second.tokens("b") == first.tokens("a")
    assert engine.metrics()["prefix_cache_hits_total"] == 8  # never the block with the last token


@pytest.mark.parametrize("prompt_len", [12, 10])  # full last block / shared partial block (CoW)
def test_n_choices_share_prompt_blocks(make_engine, run_engine, prompt_of, prompt_len) -> None:
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=123, ignore_eos=True)
    engine = make_engine(enable_prefix_caching=False)
    computed = count_prefill_tokens(engine)
    capacity = engine.free_token_capacity()
    engine.add_request("n4", prompt_of(prompt_len, 9), params)
    outs = engine.step()  # prefill once, fork, sample 4 first tokens
    assert sorted(o.index for o in outs) == [0, 1, 2, 3]
    prompt_blocks = -(-prompt_len // 4)
    assert capacity - engine.free_token_capacity() == 4 * prompt_blocks  # shared, not 4x
    outs += engine.step()  # each choice writes its first token: a block (or CoW copy) each
    used_blocks = (capacity - engine.free_token_capacity()) // 4
    # A full last block: 4 new blocks. A shared partial one: 3 private copies
    # (copy-on-write), the last writer keeps the original.
    assert used_blocks == prompt_blocks + (4 if prompt_len % 4 == 0 else 3)
    run = run_engine(engine, resumed=True)
    assert computed[0] == prompt_len and sum(computed) == prompt_len
    assert engine.audit() == []

    # Same seeds with the contiguous pool (forks copy rows, no sharing): same text.
    contiguous = make_engine(kv_cache_backend="contiguous")
    ref = run_engine(contiguous, [("n4", prompt_of(prompt_len, 9), params)])
    whole = {i: outs_tokens(outs, i) + run.tokens("n4", i) for i in range(4)}
    for i in range(4):
        assert whole[i] == ref.tokens("n4", i)
        assert ref.choices[("n4", i)].finish_reason == "length"
    assert len({tuple(t) for t in whole.values()}) == 4  # the choices really differ


def outs_tokens(outs, index: int) -> list[int]:
    return [t for o in outs if o.index == index for t in o.new_token_ids]


def test_n_choices_survive_preemption(make_engine, run_engine, prompt_of) -> None:
    params = SamplingParams(n=3, max_tokens=14, temperature=0.8, seed=5, ignore_eos=True)
    requests = [("n3", prompt_of(6, 3), params), ("other", prompt_of(5, 4), params)]
    roomy = run_engine(make_engine(), requests)
    tight = make_engine(num_gpu_blocks=7)  # 28 tokens; one choice needs 5 blocks
    run = run_engine(tight, requests)
    assert tight.metrics()["num_preemptions_total"] > 0
    for key, choice in roomy.choices.items():
        assert run.choices[key].token_ids == choice.token_ids, key
    assert tight.audit() == []


def test_seeded_sampling_is_reproducible(make_engine, run_engine, prompt_of) -> None:
    prompt = prompt_of(8, 0)
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    alone = run_engine(make_engine(), [("s", prompt, params)])
    crowd = [
        (f"c{i}", prompt_of(5 + i, i), SamplingParams(max_tokens=10, temperature=1.5))
        for i in range(3)
    ]
    crowded = run_engine(make_engine(max_batch_size=4), [*crowd, ("s", prompt, params)])
    assert crowded.tokens("s") == alone.tokens("s")
    other_seed = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=8, ignore_eos=True)
    assert run_engine(make_engine(), [("s", prompt, other_seed)]).tokens("s") != alone.tokens("s")


def test_unseeded_requests_follow_the_engine_seed(make_engine, run_engine, prompt_of) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    requests = [(f"u{i}", prompt_of(6, i), params) for i in range(2)]
    a = run_engine(make_engine(seed=1), requests)
    b = run_engine(make_engine(seed=1), requests)
    c = run_engine(make_engine(seed=2), requests)
    assert a.tokens("u0") == b.tokens("u0") and a.tokens("u1") == b.tokens("u1")
    assert (a.tokens("u0"), a.tokens("u1")) != (c.tokens("u0"), c.tokens("u1"))
