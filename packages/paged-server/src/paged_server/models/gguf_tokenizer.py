"""The tokenizer a GGUF file carries (``tokenizer.ggml.*``), built with ``tokenizers``.

A GGUF has no tokenizer.json: it stores the vocabulary, the merges, the
token types and the special ids as metadata, and names the pre-tokenizer
(``tokenizer.ggml.pre``, llama.cpp's name for the split regex). Byte-level
BPE (``tokenizer.ggml.model == "gpt2"``: GPT-2, Llama 3, Qwen 2/3) is
rebuilt here for the pre-tokenizers named below; a file that embeds its
tokenizer.json (``tokenizer.huggingface.json``) uses that. Anything else
(sentencepiece vocabularies, unknown split rules) is refused with the way
out: ``--tokenizer DIR``, the model's Hugging Face tokenizer.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from paged_server.models.errors import InvalidConfigError
from paged_server.models.gguf import GGUFFile
from paged_server.tokenizer import Tokenizer

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split regex, NFC first); None: GPT-2's own ByteLevel regex.
PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "gpt-2": (None, False),
    "llama-bpe": (_LLAMA3_SPLIT, False),
    "llama3": (_LLAMA3_SPLIT, False),
    "smaug-bpe": (_LLAMA3_SPLIT, False),
    "qwen2": (_QWEN2_SPLIT, True),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, True),
}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}  # fmt: skip


def unsupported_reason(file: GGUFFile) -> str | None:
    """Why the file's own tokenizer cannot be built (None: it can)."""
    if file.value("tokenizer.huggingface.json"):
        return None
    model = file.value("tokenizer.ggml.model")
    pre = file.value("tokenizer.ggml.pre", "default")
    if model == "gpt2" and pre in PRE_TOKENIZERS:
        return None
    what = (
        f"byte-level BPE with pre-tokenizer {pre!r} (tokenizer.ggml.pre; known: "
        f"{', '.join(PRE_TOKENIZERS)})"
        if model == "gpt2"
        else f"of type {model!r} (tokenizer.ggml.model; only gpt2-style byte-level BPE is built)"
    )
    return (
        f"the tokenizer in {file.path.name} is {what}, which paged-server cannot rebuild; pass "
        "--tokenizer DIR with the model's Hugging Face tokenizer (tokenizer.json)"
    )


def gguf_tokenizer(file: GGUFFile) -> Tokenizer:
    """The file's tokenizer and chat template (``tokenizer.chat_template``).
    One that cannot be built still loads (``--tokenizer`` may replace it) but
    refuses every use with the reason."""
    tokens = file.value("tokenizer.ggml.tokens") or []
    special = {
        key: tokens[int(i)]
        for key, field in _SPECIAL_IDS.items()
        if (i := file.value(f"tokenizer.ggml.{field}")) is not None and int(i) < len(tokens)
    }
    template = file.value("tokenizer.chat_template")
    reason = unsupported_reason(file)
    if reason is not None:
        return Tokenizer(_Refused(reason), chat_template=template, special_tokens=special)  # type: ignore[arg-type]
    if embedded := file.value("tokenizer.huggingface.json"):
        return Tokenizer(
            HFTokenizer.from_str(embedded), chat_template=template, special_tokens=special
        )
    return Tokenizer(_byte_level_bpe(file, tokens), chat_template=template, special_tokens=special)


def eos_token_ids(file: GGUFFile) -> list[int]:
    """The ids that end generation: EOS, and the end-of-turn / end-of-message
    ids llama.cpp also stops at."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    return [int(v) for k in keys if (v := file.value(f"tokenizer.ggml.{k}")) is not None]


def _byte_level_bpe(file: GGUFFile, tokens: list[str]) -> HFTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in file.value("tokenizer.ggml.merges") or []]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise InvalidConfigError(
            f"{file.path.name} lists a token twice in tokenizer.ggml.tokens; the file is damaged: "
            "pass --tokenizer DIR with the model's Hugging Face tokenizer"
        )
    tok = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    split, nfc = PRE_TOKENIZERS[file.value("tokenizer.ggml.pre", "gpt-2")]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    kinds = dict(enumerate(file.value("tokenizer.ggml.token_type") or []))
    # Control tokens (<|im_end|>) are special; user-defined ones (<think>) are matched whole.
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False) for i, t in enumerate(tokens) if kinds.get(i) == CONTROL
    ])  # fmt: skip
    tok.add_tokens([
        AddedToken(t, special=False, normalized=False) for i, t in enumerate(tokens) if kinds.get(i) == USER_DEFINED
    ])  # fmt: skip
    tok.post_processor = _post_processor(file, tokens)
    return tok


def _post_processor(file: GGUFFile, tokens: list[str]) -> Any:
    """BOS / EOS around each text where the file asks for them (``add_bos_token``)."""
    bos, eos = file.value("tokenizer.ggml.bos_token_id"), file.value("tokenizer.ggml.eos_token_id")
    add_bos = bool(file.value("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(file.value("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if not (add_bos or add_eos):
        return processors.ByteLevel(trim_offsets=False)
    first = [tokens[int(bos)]] if add_bos else []
    last = [tokens[int(eos)]] if add_eos else []
    single = " ".join([*first, "$A", *last])
    pair = " ".join([*first, "$A", *last, *first, "$B:1", *last])
    ids = {tokens[int(i)]: int(i) for i, wanted in ((bos, add_bos), (eos, add_eos)) if wanted}
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(ids.items()))


class _Refused:
    """Stands in for a tokenizer the file's metadata cannot build: any use raises the reason."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __getattr__(self, name: str) -> Any:
        raise InvalidConfigError(self.reason)
