"""Beam search in the engine: beams share their prompt's blocks and fork
copy-on-write, the audit stays clean after every step, preemption under a
tight pool and the contiguous pool give the same beams, and bad
parameters are refused with a clear message."""

from __future__ import annotations

import math

import pytest

from paged_server.sampling_params import BeamSearchParams, SamplingParams

PROMPT_LEN = 14
MAX_TOKENS = 12


def beam_params(k: int, **kw) -> SamplingParams:
    return BeamSearchParams(beam_width=k, max_tokens=MAX_TOKENS, **kw).to_sampling_params()


def run_checked(engine, requests):
    """Step to completion, auditing after every step; returns
    ({request_id: [(token_ids, cumulative_logprob, finish_reason)]}, peak blocks used)."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    results: dict[str, dict[int, list]] = {r: {} for r, _, _ in requests}
    peak = 0
    while engine.has_unfinished():
        for out in engine.step():
            entry = results[out.request_id].setdefault(out.index, [[], None, None])
            entry[0] += out.new_token_ids
            if out.finished:
                entry[1], entry[2] = out.cumulative_logprob, out.finish_reason
        assert engine.audit() == []
        stats = engine.pool.stats()
        peak = max(peak, int(stats.get("blocks_used", 0)))
    return {r: [tuple(v[i]) for i in sorted(v)] for r, v in results.items()}, peak


@pytest.mark.parametrize("k", [2, 4, 8])
def test_beams_share_blocks_and_keep_the_audit_clean(make_engine, prompt_of, k) -> None:
    engine = make_engine(num_gpu_blocks=128)
    prompt = prompt_of(PROMPT_LEN, k)
    results, peak = run_checked(engine, [("b", prompt, beam_params(k))])
    beams = results["b"]
    assert len(beams) == k
    scores = [cum / len(tokens) for tokens, cum, _ in beams]
    assert scores == sorted(scores, reverse=True)  # best first (length_penalty 1)
    assert len({tuple(tokens) for tokens, _, _ in beams}) == k  # k distinct beams
    # k independent sequences would each hold their whole history.
    independent = k * math.ceil((PROMPT_LEN + MAX_TOKENS - 1) / 4)
    assert peak < independent
    if k > 1:  # the prompt's full blocks are held once, not k times
        assert peak <= independent - (k - 1) * (PROMPT_LEN // 4)
    assert engine.pool.stats()["forks"] >= k - 1
    assert engine.audit() == []
    assert engine.metrics()["kv_cache_usage_perc"] == 0.0  # everything given back


def test_preemption_and_contiguous_pool_give_the_same_beams(make_engine, prompt_of) -> None:
    k = 4
    requests = [
        ("b0", prompt_of(PROMPT_LEN, 1), beam_params(k)),
        ("g", prompt_of(9, 2), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)),
        ("b1", prompt_of(PROMPT_LEN - 3, 3), beam_params(k, length_penalty=0.5)),
    ]
    roomy, _ = run_checked(make_engine(num_gpu_blocks=256, max_batch_size=12), requests)
    tight_engine = make_engine(num_gpu_blocks=28, max_batch_size=12)
    tight, _ = run_checked(tight_engine, requests)
    assert tight_engine.metrics()["num_preemptions_total"] > 0
    contiguous, _ = run_checked(
        make_engine(kv_cache_backend="contiguous", max_batch_size=12), requests
    )
    for run in (tight, contiguous):
        for request_id in ("b0", "g", "b1"):
            assert [b[0] for b in run[request_id]] == [b[0] for b in roomy[request_id]]
            for ours, ref in zip(run[request_id], roomy[request_id], strict=True):
                if ref[1] is not None:
                    assert ours[1] == pytest.approx(ref[1], abs=1e-4)


def test_n_returns_the_best_of_the_beams(make_engine, prompt_of) -> None:
    prompt = prompt_of(PROMPT_LEN, 5)
    all_beams, _ = run_checked(make_engine(), [("a", prompt, beam_params(4))])
    params = SamplingParams(n=2, best_of=4, use_beam_search=True, max_tokens=MAX_TOKENS)
    two, _ = run_checked(make_engine(), [("a", prompt, params)])
    assert [b[0] for b in two["a"]] == [b[0] for b in all_beams["a"][:2]]


def test_abort_frees_every_beam(make_engine, prompt_of) -> None:
    engine = make_engine()
    engine.add_request("a", prompt_of(PROMPT_LEN, 6), beam_params(4))
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert sorted(o.index for o in outputs) == [0, 1, 2, 3]
    assert all(o.finish_reason == "abort" for o in outputs)
    assert engine.audit() == []


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(n=4, best_of=2, use_beam_search=True), "best_of: the beam width must be >= n"),
        (SamplingParams(n=1, best_of=3), "best_of: must equal n or be omitted"),
        (SamplingParams(use_beam_search=True, stop=["x"]), "stop: stop strings are not supported"),
        (SamplingParams(use_beam_search=True, early_stopping="sometimes"), "early_stopping"),
        (SamplingParams(use_beam_search=True, presence_penalty=1.0), "presence_penalty"),
        (SamplingParams(n=1, best_of=9, use_beam_search=True), "best_of: must be <= 8"),
    ],
)
def test_bad_beam_parameters_are_refused(make_engine, prompt_of, params, message) -> None:
    with pytest.raises(ValueError, match=message):
        make_engine().add_request("x", prompt_of(5, 1), params)


def test_beam_search_that_cannot_fit_the_pool_is_refused(make_engine, prompt_of) -> None:
    engine = make_engine(num_gpu_blocks=16)
    with pytest.raises(ValueError, match="beam search of width 8 .* needs up to"):
        engine.add_request("x", prompt_of(PROMPT_LEN, 1), beam_params(8))


def test_beam_search_params_refuse_temperature() -> None:
    with pytest.raises(ValueError, match="temperature: beam search is deterministic"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7).to_sampling_params()
