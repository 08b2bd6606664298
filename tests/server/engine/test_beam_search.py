"""Beam search in the engine: beams share their prompt's blocks and fork
copy-on-write, the audit stays clean after every step, preemption under a
tight pool and the contiguous pool give the same beams, and bad
parameters are refused with a clear message."""

from __future__ import annotations

import math

import pytest
import torch

from paged_server.sampling_params import BeamSearchParams, SamplingParams

PROMPT_LEN = 14
MAX_TOKENS = 12
EOS = 0  # the tiny checkpoint's (tests/server/engine/conftest.py)


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
        stats = engine.kv_manager.stats()
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
    assert engine.kv_manager.stats()["forks"] >= k - 1
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


@pytest.mark.parametrize("penalty", [10.5, -11.0, 1024.0])
def test_length_penalty_is_bounded_at_submission(make_engine, prompt_of, penalty) -> None:
    with pytest.raises(ValueError, match="length_penalty: must be"):
        make_engine().add_request("x", prompt_of(5, 1), beam_params(2, length_penalty=penalty))


@pytest.mark.parametrize("penalty", [2000.0, -2000.0])
def test_scores_saturate_instead_of_overflowing(penalty) -> None:
    """``length ** 2000`` overflowed (OverflowError) and ``length ** -2000``
    underflows to 0 (a zero score / 0 is NaN); the search still ends with
    ``k`` ordered hypotheses."""
    from paged_server.engine.sample.beam_scorer import BeamScorer

    search = BeamScorer(
        beam_width=2, max_tokens=4, length_penalty=penalty, early_stopping=False,
        stop_token_ids=frozenset({0}),
    )
    gen = torch.Generator().manual_seed(0)
    while not search.done:
        logits = torch.randn(2, 16, generator=gen)
        logits[:, 0] = 4.0  # stop often, so hypotheses finish at several lengths
        search.step(torch.log_softmax(logits, dim=-1))
    best = search.best(2)
    assert len(best) == 2
    assert not any(math.isnan(h.score) for h in best)
    assert best[0].score >= best[1].score


def _collect(engine, request_id, prompt, params):
    """{index: (token_ids, logprobs, top_logprobs, finish_reason)} of one request."""
    engine.add_request(request_id, prompt, params)
    got: dict[int, tuple[list, list, list, str | None]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens, lps, tops, _ = got.setdefault(out.index, ([], [], [], None))
            tokens += out.new_token_ids
            lps += out.new_logprobs or []
            tops += out.new_top_logprobs or []
            if out.finished:
                assert out.error is None, out.error
                got[out.index] = (tokens, lps, tops, out.finish_reason)
    assert engine.audit() == []
    return got


def test_logit_bias_steers_the_beams(make_engine, prompt_of) -> None:
    """A +100 bias makes one token all but certain: the best beam repeats
    it; a -100 bias keeps the unbiased best beam's first token out."""
    prompt = prompt_of(PROMPT_LEN, 7)
    plain = _collect(make_engine(), "p", prompt, beam_params(2, ignore_eos=True))
    favoured = 123
    boosted = _collect(
        make_engine(), "b", prompt,
        SamplingParams(n=2, best_of=2, use_beam_search=True, max_tokens=MAX_TOKENS,
                       ignore_eos=True, logit_bias={favoured: 100.0}),
    )
    assert boosted[0][0] == [favoured] * MAX_TOKENS
    banned = plain[0][0][0]
    avoided = _collect(
        make_engine(), "a", prompt,
        SamplingParams(n=2, best_of=2, use_beam_search=True, max_tokens=MAX_TOKENS,
                       ignore_eos=True, logit_bias={banned: -100.0}),
    )
    assert all(banned not in tokens for tokens, *_ in avoided.values())


def test_min_tokens_holds_off_eos_in_every_beam(make_engine, prompt_of) -> None:
    """EOS made near-certain by a bias still waits for ``min_tokens``: every
    beam ends with EOS right after them (without it, at the first token)."""
    params = SamplingParams(
        n=3, best_of=3, use_beam_search=True, max_tokens=MAX_TOKENS,
        logit_bias={EOS: 100.0}, min_tokens=5,
    )
    beams = _collect(make_engine(), "m", prompt_of(PROMPT_LEN, 8), params)
    for tokens, _, _, reason in beams.values():
        assert reason == "stop"
        assert len(tokens) == 6 and tokens[-1] == EOS and EOS not in tokens[:-1]


def test_beam_logprobs_carry_top_alternatives(make_engine, prompt_of, greedy) -> None:
    """``logprobs: 5`` gives each beam token its 5 most likely alternatives;
    at the first position they are the prompt's next-token distribution,
    the same as sampling reports."""
    prompt = prompt_of(PROMPT_LEN, 9)
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, max_tokens=MAX_TOKENS,
                            ignore_eos=True, logprobs=5)
    beams = _collect(make_engine(), "l", prompt, params)
    for tokens, lps, tops, _ in beams.values():
        assert len(lps) == len(tops) == len(tokens) == MAX_TOKENS
        for token, lp, top in zip(tokens, lps, tops, strict=True):
            assert len(top) == 5
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True)
            assert lp <= values[0] + 1e-6
            if token in dict(top):
                assert dict(top)[token] == pytest.approx(lp, abs=1e-5)
    sampled = _collect(make_engine(), "s", prompt, greedy(1, logprobs=5))
    expected = sampled[0][2][0]
    for _, _, tops, _ in beams.values():
        assert [t for t, _ in tops[0]] == [t for t, _ in expected]
        assert [v for _, v in tops[0]] == pytest.approx([v for _, v in expected], abs=1e-5)
