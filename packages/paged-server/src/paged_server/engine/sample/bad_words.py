"""``bad_words`` as token ids, indexed once per request so that a step costs
only the matches in progress, however many words there are.

vLLM's rule: each word is banned alone and after a space; its last token is
masked when the output ends with the tokens before it (a one-token word at
every step). The words are encoded when the request is submitted (the API
does it on a worker thread, off the engine's), into the set of one-token
words and a table of the endings of the longer words' prefixes: a step
looks at the output's last token, then its last two, and so on only while
some prefix still ends that way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor


class BadWords:
    """One request's banned words as token ids."""

    __slots__ = ("_always", "_tails", "always")

    def __init__(self, words: Iterable[Sequence[int]]) -> None:
        always: set[int] = set()
        # Every ending of every longer word's prefix (the tokens before its
        # last), to the last tokens banned when the output ends with it (an
        # empty list: only the ending of a longer prefix).
        self._tails: dict[tuple[int, ...], list[int]] = {}
        for word in {tuple(w) for w in words if w}:
            if len(word) == 1:
                always.add(word[0])
                continue
            prefix = word[:-1]
            for n in range(1, len(prefix)):
                self._tails.setdefault(prefix[-n:], [])
            self._tails.setdefault(prefix, []).append(word[-1])
        self.always = tuple(sorted(always))  # one-token words: masked at every step
        self._always = torch.tensor(self.always, dtype=torch.long)

    def banned_after(self, token_ids: Sequence[int], start: int) -> list[int]:
        """Last tokens of the longer words whose other tokens end the output
        ``token_ids[start:]`` (``always`` not included): the output's endings
        are looked up, longer ones only while a shorter one matched."""
        banned: list[int] = []
        end = len(token_ids)
        for first in range(end - 1, start - 1, -1):
            bans = self._tails.get(tuple(token_ids[first:end]))
            if bans is None:
                break
            banned += bans
        return banned

    def always_ids(self, device: torch.device) -> Tensor:
        """``always`` as a tensor on ``device``."""
        return self._always.to(device)


def index_bad_words(tokenizer: Any, words: Sequence[str]) -> BadWords:
    """``words`` encoded as vLLM does (each alone and after a space, without
    special tokens), in one batch."""
    texts = [t for w in words for t in (w.lstrip(), " " + w.lstrip())]
    return BadWords(tokenizer.encode_batch(texts, add_special_tokens=False))
