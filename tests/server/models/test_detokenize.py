"""Streaming detokenization: deltas concatenate to the full decode for any
token stream, never show half a character, and keep word spacing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, SentencePieceBPETokenizer, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

from paged_server.default_model.tokenizer_builder import build_tokenizer, training_texts
from paged_server.engine.output.detokenize import IncrementalDetokenizer
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


def _byte_fallback() -> Tokenizer:
    """Llama-style: characters outside the vocab become <0xNN> byte tokens,
    and an invalid byte run decodes to one U+FFFD per byte."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ["▁", *"abcdefghilnorstuwé", "▁a", "▁t", "he", "▁the"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("▁", "t"), ("h", "e"), ("▁t", "he")]
    tok = HFTokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return Tokenizer(tok)


def _non_monotonic() -> Tokenizer:
    """A decoder whose text for more tokens need not extend the text for fewer
    ("a" then "ab" -> "X"): the Rust DecodeStream raises on it."""
    tok = HFTokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "<unk>": 3}, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    tok.add_special_tokens([AddedToken("<s>", special=True)])
    return Tokenizer(tok)


TOKENIZERS = {"byte_level": _byte_level(), "metaspace": _metaspace()}
# Not in TOKENIZERS: a byte-fallback decode is not monotonic (<0x00> alone is
# "\x00", <0x00><0x80> is two U+FFFD), so no stream can always concatenate to
# the full decode of random ids; streams of real text do.
ODD_TOKENIZERS = {"byte_fallback": _byte_fallback(), "non_monotonic": _non_monotonic()}
ALL_TOKENIZERS = {**TOKENIZERS, **ODD_TOKENIZERS}


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


@pytest.mark.parametrize("name", [*sorted(TOKENIZERS), "byte_fallback"])
def test_no_half_characters_and_spacing_kept(name):
    tok = ALL_TOKENIZERS[name]
    text = "naïve café — Größe 😀 über 東京 and    spaced   words"
    ids = tok.encode(text, add_special_tokens=False)
    deltas = _stream(tok, [[i] for i in ids], skip=True)
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    if name != "metaspace":
        assert "".join(deltas) == text  # byte-level BPE and byte fallback are lossless


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


class _PythonOnly:
    """The same Rust tokenizer behind a Python proxy: not a
    ``tokenizers.Tokenizer``, so the detokenizer takes its window path."""

    def __init__(self, hf: HFTokenizer) -> None:
        self._hf = hf

    def __getattr__(self, name: str):
        return getattr(self._hf, name)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), skip=st.booleans())
@pytest.mark.parametrize("name", sorted(ALL_TOKENIZERS))
def test_rust_stream_matches_window_path_delta_for_delta(name, data, skip):
    # Differential: the DecodeStream path and the window path on the same
    # stream (real text, so multi-byte characters split across tokens, then
    # random ids: specials, stray bytes) give the same delta at every step.
    tok = ALL_TOKENIZERS[name]
    any_id = st.integers(0, tok.vocab_size - 1)
    text_ids = tok.encode(data.draw(st.text(max_size=12)), add_special_tokens=False)
    ids = text_ids + data.draw(st.lists(any_id, max_size=30))
    context = data.draw(st.lists(any_id, max_size=8))
    fast = IncrementalDetokenizer(tok, skip_special_tokens=skip, context_ids=context)
    slow = IncrementalDetokenizer(
        Tokenizer(_PythonOnly(tok.hf)), skip_special_tokens=skip, context_ids=context
    )
    i = 0
    while i < len(ids):
        size = data.draw(st.integers(1, 3))
        chunk = ids[i] if size == 1 else ids[i : i + size]  # the engine adds an int
        assert fast.add(chunk) == slow.add(chunk), (ids, i)
        i += size
    assert fast.flush() == slow.flush()


@pytest.mark.parametrize("name", [*sorted(TOKENIZERS), "byte_fallback"])
def test_rust_tokenizers_stream_until_flush(name):
    # Guards the differential test above against comparing the window path with itself.
    tok = ALL_TOKENIZERS[name]
    detok = IncrementalDetokenizer(tok, context_ids=tok.encode("Hi", add_special_tokens=False))
    for i in tok.encode(" naïve 😀 café", add_special_tokens=False):
        detok.add(i)
    assert detok._stream is not None


def test_stream_error_hands_over_to_the_window_path():
    tok = ODD_TOKENIZERS["non_monotonic"]
    ids = [0, 1, 2, 2]  # "a", then "ab" -> "X": not an extension of "a", DecodeStream raises
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert detok._stream is None
    slow = IncrementalDetokenizer(Tokenizer(_PythonOnly(tok.hf)))
    assert deltas + [detok.flush()] == [slow.add(i) for i in ids] + [slow.flush()]


def test_without_the_rust_stream_the_window_path_serves(monkeypatch):
    """An older tokenizers (no DecodeStream, or one that cannot start from
    ids) leaves the detokenizer on the window path, same text."""
    from paged_server.engine.output import detokenize

    tok = ALL_TOKENIZERS[sorted(TOKENIZERS)[0]]
    ids = tok.encode(" naïve 😀 café", add_special_tokens=False)
    with_stream = IncrementalDetokenizer(tok)
    expected = [with_stream.add(i) for i in ids] + [with_stream.flush()]

    def too_old(*args, **kwargs):
        raise TypeError("DecodeStream.__new__() got an unexpected keyword argument")

    for stand_in in (None, too_old):
        monkeypatch.setattr(detokenize, "DecodeStream", stand_in)
        detok = IncrementalDetokenizer(tok)
        assert detok._stream is None
        assert [detok.add(i) for i in ids] + [detok.flush()] == expected
