"""One request's post-forward work that raises (prompt scoring, sampling,
grammar masking and matching, logprobs, detokenizing, a beam step) fails
that request only: a neighbour in the same step finishes with the tokens it
gets alone, the audit stays clean, every block comes back, and the offline
``LLM`` goes on serving after a failure."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import paged_server.engine.core.llm_engine as engine_module
import paged_server.engine.sample.grammar_mask as structured_module
from paged_server.engine.core.llm_engine import LLMEngine
from paged_server.entrypoints.llm import LLM
from paged_server.output_constraint import StructuredOutputsParams
from paged_server.sampling_params import SamplingParams

BAD = "bad"


def _is_bad(seq: Any) -> bool:
    return seq.request.request_id == BAD


def _raise(what: str) -> None:
    raise RuntimeError(f"injected {what} fault")


def _patch_score_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    real = LLMEngine._score_prompt

    def score(self: LLMEngine, seq: Any, scores: Any) -> None:
        if _is_bad(seq):
            _raise("prompt logprobs")
        real(self, seq, scores)

    monkeypatch.setattr(LLMEngine, "_score_prompt", score)


def _patch_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched sampler raises whenever the bad request (seed 666) is in it
    (in the filters every batch with a sampled row runs)."""
    import paged_server.engine.sample.sampler as sampler_module

    real = sampler_module._filtered_probs

    def filtered(logits: Any, rows: Any) -> Any:
        if any(r.params.seed == 666 for r in rows):
            _raise("sampling")
        return real(logits, rows)

    monkeypatch.setattr(sampler_module, "_filtered_probs", filtered)


def _patch_logprobs(monkeypatch: pytest.MonkeyPatch) -> None:
    import paged_server.engine.sample.sampler as sampler_module

    def gather(*args: Any) -> Any:  # only the bad request asks for logprobs
        _raise("logprobs")

    monkeypatch.setattr(sampler_module, "gather_logprobs", gather)


def _patch_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    def fill(*args: Any) -> Any:  # only the bad request has a grammar
        _raise("grammar mask")

    monkeypatch.setattr(structured_module, "fill_next_token_bitmask", fill)


def _patch_accept(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken:
        def __init__(self, matcher: Any) -> None:
            self.matcher = matcher

        def __getattr__(self, name: str) -> Any:
            return getattr(self.matcher, name)

        def consume_token(self, token: int) -> bool:
            _raise("grammar accept")
            return False

    real = structured_module.StructuredOutput.matchers

    def matchers(self: Any, spec: Any, n: int) -> list[Any]:
        return [m if m is None else Broken(m) for m in real(self, spec, n)]

    monkeypatch.setattr(structured_module.StructuredOutput, "matchers", matchers)


def _patch_append(monkeypatch: pytest.MonkeyPatch) -> None:
    real = engine_module.add_token_text

    def add_text(seq: Any, *args: Any) -> None:
        if _is_bad(seq):
            _raise("detokenizer")
        real(seq, *args)

    monkeypatch.setattr(engine_module, "add_token_text", add_text)


def _patch_beam_step(monkeypatch: pytest.MonkeyPatch) -> None:
    real = engine_module.advance_beams

    def advance(request: Any, *args: Any) -> bool:
        if request.request_id == BAD:
            raise OverflowError("injected (34, 'Numerical result out of range')")
        return real(request, *args)

    monkeypatch.setattr(engine_module, "advance_beams", advance)


_JSON = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
_BEAMS = SamplingParams(n=2, best_of=2, use_beam_search=True, max_tokens=6, ignore_eos=True)

CASES: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], SamplingParams, str]] = {
    "prompt_logprobs": (
        _patch_score_prompt,
        SamplingParams(max_tokens=6, prompt_logprobs=2),
        "prompt logprobs failed: RuntimeError: injected prompt logprobs fault",
    ),
    "sampling": (
        _patch_sample,
        SamplingParams(max_tokens=6, seed=666),
        "injected sampling fault",  # the sampler names it: "sampling failed: ..."
    ),
    "logprobs": (
        _patch_logprobs,
        SamplingParams(max_tokens=6, logprobs=3),
        "injected logprobs fault",
    ),
    "grammar_mask": (
        _patch_mask,
        SamplingParams(max_tokens=6, structured_outputs=_JSON),
        "structured output failed: RuntimeError: injected grammar mask fault",
    ),
    "grammar_accept": (
        _patch_accept,
        SamplingParams(max_tokens=6, structured_outputs=_JSON),
        "structured output failed: RuntimeError: injected grammar accept fault",
    ),
    "detokenizing": (
        _patch_append,
        SamplingParams(max_tokens=6),
        "detokenization failed: RuntimeError: injected detokenizer fault",
    ),
    "beam_step": (
        _patch_beam_step,
        _BEAMS,
        "beam search failed: OverflowError: injected",
    ),
}


@pytest.mark.parametrize("async_output_proc", [False, True], ids=["in_step", "async_output"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_fault_in_one_requests_post_forward_work_fails_that_request_only(
    case, async_output_proc, make_engine, run_engine, prompt_of, greedy, monkeypatch
) -> None:
    patch, bad_params, message = CASES[case]
    neighbours = [
        ("good", prompt_of(11, 1), greedy(8)),
        ("sampled", prompt_of(7, 2), SamplingParams(max_tokens=8, seed=3, ignore_eos=True)),
    ]
    ref = run_engine(make_engine(), neighbours)
    patch(monkeypatch)
    engine = make_engine(async_output_proc=async_output_proc)
    # Submitted together: the bad request's first token comes in the neighbours' step.
    run = run_engine(engine, [(BAD, prompt_of(9, 3), bad_params), *neighbours])
    for index in range(bad_params.n):
        choice = run.choices[(BAD, index)]
        assert choice.finish_reason == "error", (case, choice)
        assert message in (choice.error or ""), choice.error
    for request_id, _, _ in neighbours:
        assert run.choices[(request_id, 0)].finish_reason == "length"
        assert run.choices[(request_id, 0)].error is None
        assert run.tokens(request_id) == ref.tokens(request_id)
    assert engine.audit() == []
    assert engine.metrics()["kv_cache_usage_perc"] == 0.0
    # The engine goes on: a later request runs as it would alone.
    again = run_engine(engine, [("later", neighbours[0][1], greedy(8))])
    assert again.tokens("later") == ref.tokens("good")


def test_a_length_penalty_that_overflowed_fails_nothing(
    make_engine, run_engine, prompt_of, greedy
) -> None:
    """``length ** length_penalty`` overflowed a float at ~1024 and the
    OverflowError failed every request in the step. Past the submission
    bound (set on the scorer directly), scores now saturate instead."""
    neighbour = ("good", prompt_of(11, 1), greedy(8))
    ref = run_engine(make_engine(), [neighbour])
    engine = make_engine()
    params = SamplingParams(n=2, best_of=2, use_beam_search=True, max_tokens=6, ignore_eos=True)
    engine.add_request("beams", prompt_of(9, 3), params)
    engine._requests["beams"].beam.length_penalty = 2000.0  # what submission now refuses
    run = run_engine(engine, [neighbour])
    assert run.tokens("good") == ref.tokens("good")
    assert run.choices[("good", 0)].finish_reason == "length"
    for index in range(2):
        assert run.choices[("beams", index)].finish_reason == "length"
        assert len(run.tokens("beams", index)) == 6
    assert engine.audit() == []


@pytest.mark.timeout(120)
def test_offline_llm_fails_one_prompt_and_serves_the_next_call(
    tiny_loaded, monkeypatch
) -> None:
    llm = LLM(loaded=tiny_loaded, max_batch_size=4, max_model_len=128, block_size=4)
    good = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    expected = llm.generate(prompt_token_ids=[[9, 10, 11]], sampling_params=good)
    real = engine_module.advance_beams

    def advance(request: Any, *args: Any) -> bool:
        if request.request_id == "llm-1":  # the beam prompt of the next call
            raise OverflowError("injected")
        return real(request, *args)

    monkeypatch.setattr(engine_module, "advance_beams", advance)
    results = llm.generate(prompt_token_ids=[[5, 6, 7, 8], [9, 10, 11]], sampling_params=[_BEAMS, good])
    assert [c.finish_reason for c in results[0].outputs] == ["error", "error"]
    assert results[1].outputs[0].token_ids == expected[0].outputs[0].token_ids
    again = llm.generate(prompt_token_ids=[[9, 10, 11]], sampling_params=good)
    assert again[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert llm.engine.audit() == []


@pytest.mark.timeout(120)
def test_offline_llm_recovers_after_a_step_raises(tiny_loaded, monkeypatch) -> None:
    """An exception out of ``engine.step()`` (a bug, not one request's) ends
    that ``generate`` call with it; its requests are aborted and freed, so
    the next call neither hangs nor sees their outputs."""
    llm = LLM(loaded=tiny_loaded, max_batch_size=4, max_model_len=128, block_size=4)
    good = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [[9, 10, 11], [12, 13, 14, 15]]
    expected = llm.generate(prompt_token_ids=prompts, sampling_params=good)
    engine = llm.engine
    real_schedule = engine.scheduler.schedule
    calls = {"n": 0}

    def schedule() -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected scheduler bug")
        return real_schedule()

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    with pytest.raises(RuntimeError, match="injected scheduler bug"):
        llm.generate(prompt_token_ids=prompts, sampling_params=good)
    assert not engine.has_unfinished()
    assert engine.metrics()["kv_cache_usage_perc"] == 0.0
    again = llm.generate(prompt_token_ids=prompts, sampling_params=good)
    assert [r.outputs[0].token_ids for r in again] == [r.outputs[0].token_ids for r in expected]
    assert engine.audit() == []
