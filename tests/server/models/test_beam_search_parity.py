"""``LLM.beam_search`` against transformers' ``generate(num_beams=k,
do_sample=False)`` on the tiny Llama, Qwen 3 and Gemma 3 checkpoints:
every returned beam, token for token, and its score.

The checkpoints have no EOS, so each case picks stop tokens that the
search actually meets (tokens of transformers' own beams) and passes them
as EOS to transformers and as ``stop_token_ids`` to us: beams then finish
early, at different lengths, and the finished-hypothesis bookkeeping,
length penalty and early-stopping rules all decide the result."""

from __future__ import annotations

import pytest
import torch

from paged_server import LLM, BeamSearchParams

PROMPT_LEN = 13  # longer than Gemma's window of 8
MAX_TOKENS = 20  # past two more windows
PAD = -1  # transformers' fill after a beam ends (never a real token)

# (length_penalty, early_stopping, how many stop tokens)
SETTINGS = [(1.0, False, 2), (0.0, "never", 1), (2.0, True, 2), (-0.5, False, 1), (1.5, "never", 2)]


@torch.no_grad()
def hf_beams(hf_model, prompt, k, length_penalty, early_stopping, stops):
    out = hf_model.generate(
        torch.tensor([prompt]),
        num_beams=k,
        num_return_sequences=k,
        do_sample=False,
        max_new_tokens=MAX_TOKENS,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=stops or None,
        pad_token_id=PAD,
        output_scores=True,
        return_dict_in_generate=True,
    )
    return out.sequences.tolist(), out.sequences_scores.tolist()


def stop_tokens_met(hf_model, prompt, k, count):
    """Tokens transformers' beams generate (at different depths), so a
    search that uses them as EOS finishes beams at different lengths."""
    seqs, _ = hf_beams(hf_model, prompt, k, 1.0, False, [])
    picks = [seqs[0][PROMPT_LEN + 2], seqs[-1][PROMPT_LEN + 5]]
    return list(dict.fromkeys(picks))[:count]


@pytest.mark.parametrize("k", [2, 4, 8])
def test_beam_search_matches_transformers(checkpoint, k, prompt_of):
    llm = LLM(
        loaded=checkpoint.loaded,
        max_batch_size=8,
        max_model_len=64,
        block_size=4,
        device="cpu",
        attention_backend="ref",
    )
    prompt = prompt_of(PROMPT_LEN, 7)
    finished_early = 0
    for length_penalty, early_stopping, num_stops in SETTINGS:
        stops = stop_tokens_met(checkpoint.hf_model, prompt, k, num_stops)
        theirs, their_scores = hf_beams(
            checkpoint.hf_model, prompt, k, length_penalty, early_stopping, stops
        )
        params = BeamSearchParams(
            beam_width=k,
            max_tokens=MAX_TOKENS,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            stop_token_ids=stops,
        )
        ours = llm.beam_search([prompt], params)[0].sequences
        case = f"k={k} length_penalty={length_penalty} early_stopping={early_stopping} stops={stops}"
        assert len(ours) == k, case
        for beam, their_tokens, their_score in zip(ours, theirs, their_scores, strict=True):
            n = len(beam.tokens)
            assert beam.tokens == their_tokens[:n], case
            assert all(t == PAD for t in their_tokens[n:]), case
            generated = n - PROMPT_LEN
            assert len(beam.logprobs) == generated
            assert beam.cum_logprob == pytest.approx(sum(beam.logprobs), abs=1e-4)
            score = beam.cum_logprob / generated**length_penalty
            assert score == pytest.approx(their_score, abs=1e-4), case
            finished_early += beam.finish_reason == "stop"
    assert finished_early > 0  # the stop tokens did end beams
    assert llm.engine.audit() == []
