"""Streaming detokenization: deltas concatenate to the full decode for any
token stream, never show half a character, and keep word spacing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import SentencePieceBPETokenizer

from paged_server.default_model.tokenizer_builder import build_tokenizer, training_texts
from paged_server.engine.detokenize import IncrementalDetokenizer
from paged_server.tokenizer import Tokenizer


def _byte_level() -> Tokenizer:
    return Tokenizer(build_tokenizer(512))


def _metaspace() -> Tokenizer:
    """SentencePiece-style: '▁' marks spaces and the first token's is stripped."""
    tok = SentencePieceBPETokenizer()
    tok.train_from_iterator(
        training_texts()[:50],
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        show_progress=False,
    )
    return Tokenizer(tok._tokenizer)


TOKENIZERS = {"byte_level": _byte_level(), "metaspace": _metaspace()}


def _stream(tok: Tokenizer, chunks: list[list[int]], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    return [detok.add(chunk) for chunk in chunks] + [detok.flush()]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip=st.booleans())
@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_deltas_concatenate_to_full_decode(name, data, skip):
    tok = TOKENIZERS[name]
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    sizes = data.draw(st.lists(st.integers(1, 3), min_size=len(ids), max_size=len(ids)))
    chunks, i = [], 0
    for size in sizes:  # tokens arrive one or a few at a time
        if i < len(ids):
            chunks.append(ids[i : i + size])
            i += size
    assert "".join(_stream(tok, chunks, skip)) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_no_half_characters_and_spacing_kept(name):
    tok = TOKENIZERS[name]
    text = "naïve café — Größe 😀 über 東京 and    spaced   words"
    ids = tok.encode(text, add_special_tokens=False)
    deltas = _stream(tok, [[i] for i in ids], skip=True)
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    if name == "byte_level":
        assert "".join(deltas) == text  # byte-level BPE is lossless


def test_context_sets_the_first_delta_spacing():
    tok = TOKENIZERS["metaspace"]
    prompt = tok.encode("Hello", add_special_tokens=False)
    generated = tok.encode("Hello world", add_special_tokens=False)[len(prompt) :]
    detok = IncrementalDetokenizer(tok, context_ids=prompt)
    text = "".join(detok.add(t) for t in generated) + detok.flush()
    assert text == " world"


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=30), noise=st.lists(st.integers(0, 511), max_size=3))
def test_streamed_unicode_text_round_trips(text, noise):
    # Real text splits multi-byte characters across byte-level tokens; a few
    # random tokens after it add invalid or partial bytes at the end.
    tok = TOKENIZERS["byte_level"]
    ids = tok.encode(text, add_special_tokens=False)
    deltas = _stream(tok, [[i] for i in ids], skip=False)
    assert "".join(deltas) == text  # byte-level BPE is lossless (special tokens kept)
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)
    tail = _stream(tok, [[i] for i in ids + noise], skip=True)
    assert "".join(tail) == tok.decode(ids + noise)
