"""Stop strings and stop tokens through the real engine and tokenizer: the
text is cut before the stop string (even one spanning tokens), the streamed
deltas add up to the final text, and the request ends with "stop"."""

from __future__ import annotations

from paged_server.sampling_params import SamplingParams


def test_stop_string_cuts_text_across_tokens(make_engine, run_engine, prompt_of) -> None:
    prompt = prompt_of(8, 21)
    free = run_engine(make_engine(), [("a", prompt, SamplingParams(max_tokens=24, temperature=0))])
    text = free.choices[("a", 0)].text
    assert len(text) > 12
    stop = text[6:10]  # four characters: with a 512-token BPE usually two tokens or more
    want = text[: text.find(stop)]
    params = SamplingParams(max_tokens=24, temperature=0, stop=["never-there", stop])
    run = run_engine(make_engine(), [("a", prompt, params)])
    choice = run.choices[("a", 0)]
    assert choice.finish_reason == "stop"
    assert choice.text == want  # streamed deltas concatenated
    assert stop not in choice.text
    # generation stopped at the token completing the stop string
    assert choice.token_ids == free.tokens("a")[: len(choice.token_ids)]
    assert len(choice.token_ids) < 24


def test_stop_token_ids_end_generation_keeping_the_token(
    make_engine, run_engine, prompt_of
) -> None:
    prompt = prompt_of(8, 22)
    free = run_engine(make_engine(), [("a", prompt, SamplingParams(max_tokens=12, temperature=0))])
    tokens = free.tokens("a")
    stop_token = tokens[4]
    cut = tokens.index(stop_token) + 1
    params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_token])
    run = run_engine(make_engine(), [("a", prompt, params)])
    assert run.tokens("a") == tokens[:cut]
    assert run.choices[("a", 0)].finish_reason == "stop"
