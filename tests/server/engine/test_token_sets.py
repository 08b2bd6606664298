"""``bad_words`` indexed once per request (issue 53, item 5): the index bans
exactly what vLLM's rule bans, a step's cost does not grow with the number
of words, and a list past the limit is refused."""

from __future__ import annotations

import random
import time

import pytest
import torch

from paged_server.engine.bad_words import BadWords
from paged_server.engine.logits_processors import apply_logits_processors
from paged_server.engine.sampler import SamplingRow
from paged_server.sampling_params import MAX_BAD_WORDS, SamplingParams


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


def test_too_many_bad_words_are_refused_naming_the_limit() -> None:
    with pytest.raises(ValueError, match=f"^bad_words: {MAX_BAD_WORDS + 1} words, more than {MAX_BAD_WORDS}"):
        SamplingParams(bad_words=["w"] * (MAX_BAD_WORDS + 1)).validate(64)
    SamplingParams(bad_words=["w"] * MAX_BAD_WORDS).validate(64)
