"""Streaming detokenization: text deltas that concatenate to the full decode.

Decoding one token at a time is wrong twice over: byte-level tokens can end
in the middle of a UTF-8 character, and SentencePiece-style decoders drop
the leading space of whatever token comes first. So each step decodes a
short window twice, without and with the new tokens, and emits the
difference; it holds text back while it ends in an incomplete character.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from paged_server.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens decoded along with the first new ones


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    ``context_ids`` (the prompt) only set the spacing of the first delta; they
    are never emitted. With no context, the concatenation of every
    ``add()`` result and a final ``flush()`` equals
    ``tokenizer.decode(all_ids, skip_special_tokens)``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Skipped specials are dropped up front, so a window never starts with
        # one (a decoder that strips the first token's space would hit the
        # next token instead).
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._decode = tokenizer.hf.decode  # the Rust call itself: two per token
        self._ids = [i for i in context_ids if i not in self._skip]
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Append new tokens; returns the text they complete (may be "")."""
        if isinstance(token_ids, int):  # the engine's case: one token per step
            if token_ids in self._skip:
                return ""
            self._ids.append(token_ids)
        else:
            self._ids.extend(i for i in token_ids if i not in self._skip)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the stream, return text held back (an incomplete
        character at the very end decodes to U+FFFD, as in a full decode)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        ids, prefix, read = self._ids, self._prefix_offset, self._read_offset
        if read == len(ids):
            return ""
        decode, skip = self._decode, self.skip_special_tokens
        prefix_text = decode(ids[prefix:read], skip_special_tokens=skip)
        new_text = decode(ids[prefix:], skip_special_tokens=skip)
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT)):
            return ""  # mid-character, or nothing visible yet: wait for more tokens
        self._prefix_offset, self._read_offset = read, len(ids)
        return new_text[len(prefix_text) :]
