"""``bad_words`` indexed once per request (issue 53, item 5) and constraints
that leave no token (issue 53, Medium): the index bans exactly what vLLM's
rule bans, a step's cost does not grow with the number of words, and a row
whose constraints forbid every token gets an error, never a forbidden token."""

from __future__ import annotations

import random
import time

import pytest
import torch

from paged_server.engine.sample.bad_words import BadWords
from paged_server.engine.sample.logits_processors import apply_logits_processors
from paged_server.engine.sample.sampler import SamplingRow, sample
from paged_server.engine.sample.token_sets import check_first_token
from paged_server.output_constraint import StructuredOutputsParams
from paged_server.sampling_params import MAX_BAD_WORDS, SamplingParams

VOCAB = 64


def _vllm_rule(words: list[list[int]], output: list[int]) -> set[int]:
    """vLLM's bad-words rule, word by word: the last token is banned when the
    output ends with the tokens before it."""
    return {w[-1] for w in words if len(w) == 1 or output[len(output) - len(w) + 1:] == w[:-1]}


def test_the_index_bans_what_the_word_by_word_rule_bans() -> None:
    rng = random.Random(0)
    for _ in range(300):
        words = [[rng.randrange(8) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 12))]
        prompt = [rng.randrange(8) for _ in range(rng.randint(0, 3))]
        output = [rng.randrange(8) for _ in range(rng.randint(0, 6))]
        index = BadWords(words)
        found = set(index.banned_after(prompt + output, len(prompt))) | set(index.always)
        assert found == _vllm_rule(words, output), (words, prompt, output)


def _row(words: list[list[int]], output: list[int]) -> SamplingRow:
    params = SamplingParams(temperature=0.0, bad_words=["x"], bad_words_index=BadWords(words))
    return SamplingRow(params, None, [1, 2, 3, *output], 3)


def _seconds_per_step(row: SamplingRow) -> float:
    logits = torch.zeros(1, 4096)
    best = float("inf")
    for _ in range(30):
        start = time.perf_counter()
        apply_logits_processors(logits, [row])
        best = min(best, time.perf_counter() - start)
    return best


def test_a_steps_cost_does_not_grow_with_the_number_of_words() -> None:
    rng = random.Random(1)
    output = [rng.randrange(4096) for _ in range(200)]
    # one word matches in both, so both rows mask a token
    many = [[output[-1], 7]] + [[rng.randrange(4096) for _ in range(rng.randint(2, 4))]
                                 for _ in range(MAX_BAD_WORDS - 1)]
    few = many[:10]
    # Side by side in one run: 10 words against 10,000 (a word-by-word scan
    # was ~1,000x slower for the second).
    ratio = _seconds_per_step(_row(many, output)) / _seconds_per_step(_row(few, output))
    assert ratio < 5, f"10,000 words cost {ratio:.1f}x what 10 do per step"


def test_a_row_with_nothing_allowed_gets_an_error_not_a_token() -> None:
    # allowed 5 and 6; after a 5 the bad words [5, 5] and [5, 6] ban both
    params = SamplingParams(temperature=0.0, allowed_token_ids=[5, 6], bad_words=["x"],
                            bad_words_index=BadWords([[5, 5], [5, 6]]))
    free = SamplingParams(temperature=1.0, seed=1)
    rows = [SamplingRow(params, None, [1, 2, 5], 2), SamplingRow(free, torch.Generator(), [1, 2], 2),
            SamplingRow(params, None, [1, 2, 6], 2)]
    out = sample(torch.randn(3, VOCAB), rows)
    assert out.token_ids[0] == -1 and "no token can be generated" in (out.errors[0] or "")
    assert "allowed_token_ids and bad_words" in (out.errors[0] or "")
    assert out.errors[1] is None and 0 <= out.token_ids[1] < VOCAB  # the neighbours go on
    assert out.errors[2] is None and out.token_ids[2] in (5, 6)
    sampled = SamplingParams(temperature=0.8, allowed_token_ids=[5, 6], bad_words=["x"],
                             bad_words_index=BadWords([[5, 5], [5, 6]]))
    out = sample(torch.randn(1, VOCAB), [SamplingRow(sampled, torch.Generator(), [1, 2, 5], 2)])
    assert out.token_ids == [-1] and out.errors[0]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (dict(allowed_token_ids=[2], min_tokens=3, max_tokens=4), "allowed_token_ids"),
        (dict(allowed_token_ids=[5], bad_words=["x"], bad_words_index=BadWords([[5]])), "allowed_token_ids"),
        (dict(bad_words=["x"], bad_words_index=BadWords([[t] for t in range(1, VOCAB)]),
              min_tokens=1, max_tokens=2), "bad_words"),
    ],
)
def test_constraints_that_forbid_every_first_token_are_refused(params: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: no token can be generated first"):
        check_first_token(SamplingParams(**params), VOCAB, eos_token_ids=(0, 2))


def test_constraints_that_leave_a_token_are_accepted() -> None:
    check_first_token(SamplingParams(allowed_token_ids=[2, 7], min_tokens=3, max_tokens=4), VOCAB, (0, 2))
    check_first_token(SamplingParams(allowed_token_ids=[2], min_tokens=3, max_tokens=4, ignore_eos=True),
                      VOCAB, (0, 2))
    grammar = torch.zeros(VOCAB, dtype=torch.bool)
    grammar[9] = True
    choice = StructuredOutputsParams(choice=["a"])
    with pytest.raises(ValueError, match="allowed_token_ids and the structured output together"):
        check_first_token(SamplingParams(allowed_token_ids=[8], structured_outputs=choice), VOCAB, (0,), grammar)
    check_first_token(SamplingParams(allowed_token_ids=[8, 9]), VOCAB, (0,), grammar)


def test_too_many_bad_words_are_refused_naming_the_limit() -> None:
    with pytest.raises(ValueError, match=f"^bad_words: {MAX_BAD_WORDS + 1} words, more than {MAX_BAD_WORDS}"):
        SamplingParams(bad_words=["w"] * (MAX_BAD_WORDS + 1)).validate(64)
    SamplingParams(bad_words=["w"] * MAX_BAD_WORDS).validate(64)
