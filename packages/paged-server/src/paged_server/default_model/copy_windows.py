"""Training windows that repeat themselves: what teaches the trained model to copy.

A model continues a passage it was just shown only through an induction
head (attend to the token after the last place the current token
appeared, copy it). Python's own text repeats too little for 2,400 steps
to grow one (docs/kv-cache.md), so the copying model's recipe
(``train.COPYING``) shows it two kinds of windows whose repeats only
copying can predict:

- ``random_copy_windows``: random tokens with a random period, written
  over and over. Nothing but matching content predicts them, so the head
  forms in a few hundred steps from random weights (the warm start);
- ``text_copy_windows``: a span of real text written over and over, so the
  trained model trusts its copy over its own guess on real text.

Each comes with the mask of its targets worth training on: every token
after the first period (the first period cannot be predicted).
"""

from __future__ import annotations

import torch

from paged_server.default_model.corpus import Corpus

MIN_PERIOD = 8


def repeat_to_window(span: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``span`` written over and over: ``[seq_len + 1]`` tokens and the
    ``[seq_len]`` mask of targets that repeat an earlier token."""
    period = len(span)
    window = span.repeat(seq_len // period + 2)[: seq_len + 1]
    repeats = torch.arange(1, seq_len + 1) >= period  # target t is token t + 1
    return window, repeats


def _periods(count: int, seq_len: int, gen: torch.Generator) -> list[int]:
    """Periods from ``MIN_PERIOD`` to half the window, so every window repeats at least once."""
    return torch.randint(MIN_PERIOD, max(MIN_PERIOD + 1, seq_len // 2 + 1), (count,), generator=gen).tolist()


def random_copy_windows(count: int, seq_len: int, vocab: range, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` windows of random tokens from ``vocab`` repeated with random
    periods: ``[count, seq_len + 1]`` tokens, ``[count, seq_len]`` masks."""
    return _stacked([repeat_to_window(torch.randint(vocab.start, vocab.stop, (p,), generator=gen), seq_len)
                     for p in _periods(count, seq_len, gen)])  # fmt: skip


def text_copy_windows(corpus: Corpus, count: int, seq_len: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` windows of real text (drawn as ``corpus.sample`` draws)
    whose first span, of a random period, is repeated: tokens and masks."""
    text = corpus.sample(count, seq_len, gen)
    return _stacked([repeat_to_window(row[:p], seq_len) for row, p in zip(text, _periods(count, seq_len, gen), strict=True)])


def _stacked(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``repeat_to_window``'s (window, mask) pairs as one batch: long tokens, bool masks."""
    return torch.stack([w for w, _ in rows]).long(), torch.stack([m for _, m in rows])
