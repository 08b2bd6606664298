"""Streaming detokenization: text deltas that concatenate to the full decode.

Decoding one token at a time is wrong twice over: byte-level tokens can end
in the middle of a UTF-8 character, and SentencePiece-style decoders drop
the leading space of whatever token comes first. So each step decodes a
short window twice, without and with the new tokens, and emits the
difference; it holds text back while it ends in an incomplete character.

The Rust ``tokenizers.decoders.DecodeStream`` (tokenizers >= 0.22) runs the
same window algorithm inside the library: one call per step instead of two
decodes through Python, under half the host time. It drives the steps while
it can; the window path below is its fallback and keeps the same offsets,
so it can take over at any token with the same deltas.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer as HFTokenizer

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21 (an image with its own, older pin): the window path
    DecodeStream = None  # type: ignore[assignment,misc]

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
        self._hf = tokenizer.hf
        self._ids = [i for i in context_ids if i not in self._skip]
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)
        self._stream = self._new_stream()

    def _new_stream(self) -> DecodeStream | None:
        """A DecodeStream primed with the same window, or None where it would
        not match the window path: a tokenizer that is not a Rust one, or a
        context ending mid-character (the stream would emit the context)."""
        window = self._ids[self._prefix_offset :]
        if DecodeStream is None or not isinstance(self._hf, HFTokenizer):
            return None
        if self._decode(window).endswith(_REPLACEMENT):
            return None
        try:
            return DecodeStream(window, skip_special_tokens=self.skip_special_tokens)
        except TypeError:  # tokenizers 0.21: no ids to start from
            return None

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Append new tokens; returns the text they complete (may be "")."""
        if isinstance(token_ids, int):  # the engine's case: one token per step
            if token_ids in self._skip:
                return ""
            self._ids.append(token_ids)
            new: int | list[int] = token_ids
        else:
            new = [i for i in token_ids if i not in self._skip]
            if not new:
                return ""  # as the window path: nothing new completes
            self._ids.extend(new)
        if self._stream is not None:
            try:
                text = self._stream.step(self._hf, new)
            except Exception:  # e.g. "Invalid prefix": a decoder whose text is not monotonic
                self._stream = None  # the window path takes over from the same offsets
            else:
                if text is None:
                    return ""
                self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
                return text
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the stream, return text held back (an incomplete
        character at the very end decodes to U+FFFD, as in a full decode)."""
        self._stream = None  # it still holds what this emits
        return self._emit(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._hf.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _emit(self, final: bool) -> str:
        ids, prefix, read = self._ids, self._prefix_offset, self._read_offset
        if read == len(ids):
            return ""
        prefix_text = self._decode(ids[prefix:read])
        new_text = self._decode(ids[prefix:])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT)):
            return ""  # mid-character, or nothing visible yet: wait for more tokens
        self._prefix_offset, self._read_offset = read, len(ids)
        return new_text[len(prefix_text) :]


class NoText:
    """The text stream of a request with ``detokenize=False``: its outputs
    carry token ids only, and no step spends time decoding them."""

    def add(self, token_ids: int) -> str:
        return ""

    def flush(self) -> str:
        return ""
