"""Train the default model's byte-level BPE tokenizer, offline and deterministically.

The training text is CPython's own ``pydoc_data.topics`` (the help() pages,
~465 KB of English and Python), present on every installation, so no
download is needed. Same Python version, same ``tokenizers``: same file.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 4096
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)


def training_texts() -> list[str]:
    """The help() topic pages, in a fixed (sorted) order."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def build_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A GPT-2-style byte-level BPE (every byte sequence encodes; decoding
    restores the exact text) with ChatML special tokens at ids 0-2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_texts(), trainer)
    return tok
