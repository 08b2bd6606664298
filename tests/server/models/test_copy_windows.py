"""The windows that teach the trained model to copy: every target the mask
keeps repeats the token one period earlier, periods vary (so no head can
copy by position alone), and text windows repeat real text."""

from __future__ import annotations

import torch

from paged_server.default_model.copy_windows import (
    MIN_PERIOD,
    random_copy_windows,
    repeat_to_window,
    text_copy_windows,
)
from paged_server.default_model.corpus import Corpus


def period_of(row: torch.Tensor) -> int:
    """The smallest period ``row`` repeats with (its length if none)."""
    return next(p for p in range(1, len(row) + 1) if torch.equal(row[p:], row[:-p]))


def test_a_span_repeated_masks_exactly_the_first_period():
    span = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13])
    window, repeats = repeat_to_window(span, 32)
    assert window.shape == (33,) and repeats.shape == (32,)
    assert torch.equal(window[9:], window[:-9]) and torch.equal(window[:9], span)
    # target t is token t + 1: kept from the first token of the second copy on
    assert repeats.tolist() == [t + 1 >= 9 for t in range(32)]


def test_random_windows_repeat_with_varied_periods_inside_the_vocabulary():
    gen = torch.Generator().manual_seed(0)
    tokens, repeats = random_copy_windows(64, 64, range(3, 4096), gen)
    assert tokens.shape == (64, 65) and repeats.shape == (64, 64) and tokens.dtype == torch.long
    assert int(tokens.min()) >= 3 and int(tokens.max()) < 4096
    periods = [period_of(row) for row in tokens]
    assert all(MIN_PERIOD <= p <= 32 for p in periods)
    assert len(set(periods)) > 10  # varied: copying by position cannot learn them all
    for row, keep, p in zip(tokens, repeats, periods, strict=True):
        assert int(keep.sum()) == 64 - (p - 1)
        kept = [t for t in range(64) if keep[t]]
        assert all(row[t + 1] == row[t + 1 - p] for t in kept)  # each one period earlier


def test_text_windows_repeat_a_stretch_of_the_corpus():
    stream = torch.arange(10_000, dtype=torch.int32)  # every token says where it came from
    corpus = Corpus({"text": stream}, {"text": 1.0}, stream[:100], "")
    tokens, repeats = text_copy_windows(corpus, 8, 128, torch.Generator().manual_seed(1))
    assert tokens.shape == (8, 129) and repeats.shape == (8, 128)
    for row, keep in zip(tokens, repeats, strict=True):
        p = period_of(row)
        assert MIN_PERIOD <= p <= 64
        assert torch.equal(row[1:p] - row[: p - 1], torch.ones(p - 1, dtype=torch.long))  # contiguous text
        assert int(keep.sum()) == 128 - (p - 1)
