"""Fixtures shared by the engine and model tests, whose tiny checkpoints both
use the same 512-token byte-level BPE (ids 0-2 are its special tokens)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

VOCAB = 512


def random_prompt(length: int, seed: int) -> list[int]:
    """Token ids without the special tokens (0-2)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=gen).tolist()


@pytest.fixture
def prompt_of() -> Callable[[int, int], list[int]]:
    """``prompt_of(length, seed)``: random token ids (no specials)."""
    return random_prompt
