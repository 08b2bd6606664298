"""``async_output_proc``: the text of step N's tokens is made during step
N+1 (on a GPU, while its forward pass runs). What a client receives must
not change: the same tokens, text, logprobs and finish reasons as the
engine that makes text in the step that sampled the token, for every kind
of request whose end or text depends on it. Outputs come one step later;
a stop string found a step late drops the token computed meanwhile."""

from __future__ import annotations

import pytest

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
        ("until_eos", prompt_of(6, 4), SamplingParams(max_tokens=60, seed=7, temperature=1.5)),
        ("json", prompt_of(5, 5), SamplingParams(max_tokens=24, structured_outputs=_JSON)),
        ("beams", prompt_of(9, 6), SamplingParams(n=2, best_of=2, use_beam_search=True, max_tokens=6)),
        ("no_text", prompt_of(9, 7), greedy(5, detokenize=False)),
    ]


def test_async_output_proc_streams_what_the_in_step_engine_does(
    make_engine, run_engine, prompt_of, greedy
) -> None:
    probe = run_engine(make_engine(), [("plain", prompt_of(9, 1), greedy(12))])
    plain = probe.choices[("plain", 0)]
    stop = plain.text[len(plain.text) // 2 :][:2]  # a stop string some tokens in
    assert stop and plain.text.index(stop) > 0, plain.text
    requests = _requests(prompt_of, greedy, stop, plain.token_ids[5])

    ref_engine, engine = make_engine(), make_engine(async_output_proc=True)
    ref = run_engine(ref_engine, requests)
    run = run_engine(engine, requests)
    assert run.choices.keys() == ref.choices.keys()
    for key, choice in ref.choices.items():
        got = run.choices[key]
        assert (got.token_ids, got.text, got.logprobs) == (
            choice.token_ids, choice.text, choice.logprobs
        ), key
        assert (got.finish_reason, got.error) == (choice.finish_reason, choice.error), key
    # The stop string did end those two early, one token computed past it.
    assert ref.choices[("stop_string", 0)].finish_reason == "stop"
    assert len(ref.tokens("stop_string")) < len(ref.tokens("plain"))
    assert run.choices[("stop_string_kept", 0)].text.endswith(stop)
    # Outputs come a step later; the dropped token was never counted.
    assert run.first_token_step[("plain", 0)] == ref.first_token_step[("plain", 0)] + 1
    assert (
        engine.metrics()["generation_tokens_total"]
        == ref_engine.metrics()["generation_tokens_total"]
    )
    assert engine.audit() == [] and ref_engine.audit() == []
    assert engine.metrics()["kv_cache_usage_perc"] == 0.0


@pytest.mark.parametrize("at_step", [1, 2, 4])
def test_an_abort_while_text_is_pending_ends_the_request_cleanly(
    make_engine, run_engine, prompt_of, greedy, at_step
) -> None:
    engine = make_engine(async_output_proc=True)

    def abort(step: int, eng) -> None:
        if step == at_step:
            eng.abort_request("gone")

    run = run_engine(
        engine,
        [("gone", prompt_of(9, 1), greedy(12)), ("stays", prompt_of(7, 2), greedy(6))],
        on_step=abort,
    )
    assert run.choices[("gone", 0)].finish_reason == "abort"
    assert len(run.tokens("gone")) < 12
    assert run.choices[("stays", 0)].finish_reason == "length"
    assert len(run.tokens("stays")) == 6
    assert engine.audit() == []
    assert engine.metrics()["kv_cache_usage_perc"] == 0.0
