"""Stop conditions and streamed text deltas, with a scripted detokenizer
(token id -> text piece) so stop strings can span tokens on purpose."""

from __future__ import annotations

import torch

from paged_server.engine.output.output_processor import add_token_text, commit_token, take_output
from paged_server.engine.request.sequence import Request, Sequence
from paged_server.engine.sample.logprobs import TokenLogprobs
from paged_server.sampling_params import SamplingParams

PIECES = {10: "Hel", 11: "lo", 12: " wor", 13: "ld", 14: "!", 15: "##", 16: "#", 17: "\ufffd"}
EOS = 2


class ScriptedText:
    def add(self, token_ids: int) -> str:
        return PIECES.get(token_ids, "?")

    def flush(self) -> str:
        return "<flush>"


def new_seq(max_model_len_prompt: int = 3, **params) -> Sequence:
    request = Request("r", None, [5] * max_model_len_prompt, SamplingParams(**params), 0.0)
    seq = Sequence(0, request, 0, [5] * max_model_len_prompt, torch.Generator(), ScriptedText())
    request.seqs.append(seq)
    return seq


def append_token(seq: Sequence, token: int, logprob: TokenLogprobs | None, max_model_len: int) -> None:
    """One token as the engine records it in the step that sampled it."""
    commit_token(seq, token, logprob, {EOS}, max_model_len)
    add_token_text(seq, token, {EOS})


def feed(seq: Sequence, tokens: list[int], max_model_len: int = 100) -> list[str]:
    """Append tokens one by one; returns the text delta streamed after each."""
    deltas = []
    for t in tokens:
        append_token(seq, t, None, max_model_len)
        out = take_output(seq)
        deltas.append(out.new_text if out else "")
        if seq.is_finished:
            break
    return deltas


def test_stop_string_spanning_tokens_is_cut_and_never_streamed() -> None:
    seq = new_seq(stop=["lo wo"], max_tokens=50)
    deltas = feed(seq, [10, 11, 12, 13])
    assert seq.finish_reason == "stop"
    assert "".join(deltas) == "Hel" == seq.output_text
    assert seq.token_ids[-2:] == [11, 12]  # the token that completed the stop is kept
    assert "lo" not in "".join(deltas)


def test_held_back_text_is_released_once_it_cannot_start_a_stop() -> None:
    seq = new_seq(stop=["xyz"], max_tokens=50)
    deltas = feed(seq, [10, 11, 12])
    # at most len("xyz") - 1 = 2 characters wait at any time
    assert deltas == ["H", "el", "lo w"]
    assert seq.output_text == "Hello wor"


def test_length_finish_flushes_everything() -> None:
    seq = new_seq(stop=["xyz"], max_tokens=2)
    deltas = feed(seq, [10, 11])
    assert seq.finish_reason == "length"
    assert "".join(deltas) == "Hello<flush>"


def test_earliest_stop_string_wins() -> None:
    seq = new_seq(stop=["#", "##"], max_tokens=50)
    feed(seq, [14, 15])
    assert seq.output_text == "!" and seq.finish_reason == "stop"


def test_eos_and_stop_token_ids_add_no_text() -> None:
    seq = new_seq(max_tokens=50)
    feed(seq, [10, EOS])
    assert seq.finish_reason == "stop" and seq.token_ids[-1] == EOS
    assert "?" not in seq.output_text
    seq = new_seq(max_tokens=50, stop_token_ids=[13])
    feed(seq, [10, 13])
    assert seq.finish_reason == "stop"
    seq = new_seq(max_tokens=3, ignore_eos=True)
    feed(seq, [10, EOS, 11])
    assert seq.finish_reason == "length" and seq.token_ids[-3:] == [10, EOS, 11]


def test_max_model_len_ends_generation_with_length() -> None:
    seq = new_seq(max_tokens=50)
    feed(seq, [10, 11, 12, 13], max_model_len=5)  # prompt 3 + 2 generated = 5
    assert seq.finish_reason == "length" and seq.num_generated == 2


def test_finished_sequence_reports_exactly_once() -> None:
    seq = new_seq(max_tokens=1)
    append_token(seq, 10, TokenLogprobs(10, -0.5), 100)
    out = take_output(seq)
    assert out is not None and out.finished and out.new_token_ids == [10]
    assert out.new_logprobs is None  # not asked for
    assert take_output(seq) is None
