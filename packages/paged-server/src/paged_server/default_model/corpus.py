"""The trained evaluation model's text: what it trains on and what scores it.

Two sources, both on every CPython installation, so nothing is downloaded:

- the help() pages (``pydoc_data.topics``, the text the tokenizer was
  trained on): the tail of every page is the **held-out text**
  (``split_texts``), the rest trains;
- the **standard library's own sources** (``stdlib_files``): ~9 MB of Python
  with its docstrings and comments, ~2.6M tokens. Without them the model
  sees 93k tokens eleven times over and learns them by heart (held-out
  5.2 nats). Their docstrings are also drawn as a stream of their own, the
  prose nearest the held-out pages.

The standard library differs between Python releases (and distributions
patch a few files), so the chosen files are pinned by one content hash
(``STDLIB_SHA256``, of CPython 3.11.7's): another interpreter fails with an
error that says so, unless the caller accepts the difference
(``strict=False``, recorded in ``training.json``).
"""

from __future__ import annotations

import ast
import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from paged_server.default_model.tokenizer_builder import ENDOFTEXT, training_texts

HELDOUT_SHARE = 0.1  # the last ~10% of every help() page, from a paragraph break on

# Folders and files of the standard library that are not trained on: tests,
# the help() pages themselves (the held-out text lives there), GUI and
# codec tables (code without prose), and files that distributions patch.
_SKIP_DIRS = frozenset({
    "test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
    "pydoc_data", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip",
    "distutils", "encodings", "venv",
})  # fmt: skip
_SKIP_FILES = frozenset({"sysconfig.py", "site.py", "this.py", "_sysconfigdata.py"})
STDLIB_PYTHON = "3.11.7"
STDLIB_SHA256 = "1c2847cf31c0d0343744204b6388ae05c6990835eff9e403164f27c6d55c15bc"


def split_texts() -> tuple[list[str], list[str]]:
    """(training text, held-out text) of the tokenizer's pages, fixed: each
    page's tail from the last paragraph break before 90% of it is held out
    (whole pages would hold out a few short ones: 2% of the tokens), so the
    held-out text continues topics the model saw but is never trained on.
    The pages repeat some paragraphs word for word (the data model's, for
    instance): a held-out paragraph is dropped from every training page."""
    train_parts, heldout_parts = [], []
    for page in training_texts():
        cut = page.rfind("\n\n", 0, int(len(page) * (1 - HELDOUT_SHARE)))
        if cut <= 0:  # a page without a break early enough trains whole
            train_parts.append(page)
            continue
        train_parts.append(page[:cut])
        heldout_parts.append(page[cut:].strip())
    held = heldout_paragraphs(heldout_parts)
    return [drop_paragraphs(part, held) for part in train_parts], heldout_parts


def heldout_paragraphs(heldout: list[str]) -> set[str]:
    """Every paragraph of the held-out text, stripped."""
    return {p.strip() for part in heldout for p in part.split("\n\n")} - {""}


def drop_paragraphs(text: str, paragraphs: set[str]) -> str:
    """``text`` without the paragraphs (blank-line separated) in ``paragraphs``."""
    return "\n\n".join(p for p in text.split("\n\n") if p.strip() not in paragraphs)


def stdlib_files() -> list[tuple[str, bytes]]:
    """(path relative to the standard library, content) of every ``.py``
    file trained on, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        skip = set(rel.parts[:-1]) & _SKIP_DIRS or rel.name in _SKIP_FILES
        if skip or rel.name.startswith("_sysconfigdata") or rel.parts[0].startswith("config-"):
            continue
        files.append((rel.as_posix(), path.read_bytes()))
    return sorted(files)


def stdlib_digest(files: list[tuple[str, bytes]]) -> str:
    """sha256 over the files' paths and contents."""
    digest = hashlib.sha256()
    for rel, data in files:
        digest.update(rel.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def stdlib_texts(strict: bool = True) -> tuple[list[str], list[str], str]:
    """(sources, docstrings, digest) of the pinned standard-library files.
    ``strict``: raise unless they are the pinned ones (``STDLIB_SHA256``)."""
    files = stdlib_files()
    digest = stdlib_digest(files)
    if strict and digest != STDLIB_SHA256:
        raise RuntimeError(
            f"the trained model's corpus is CPython {STDLIB_PYTHON}'s standard library "
            f"(sha256 {STDLIB_SHA256[:12]}), but this interpreter's ({sys.version.split()[0]}, "
            f"{len(files)} files under {sysconfig.get_paths()['stdlib']}) hashes to "
            f"{digest[:12]}: the model would differ from the published one. Train with "
            f"Python {STDLIB_PYTHON}, or on this one with `python -m "
            "paged_server.default_model.train OUT_DIR --any-stdlib` (strict_corpus=False; "
            "training.json records its hash) and serve --model OUT_DIR."
        )
    sources = [data.decode("utf-8") for _, data in files]
    return sources, [doc for src in sources for doc in docstrings(src)], digest


def docstrings(source: str) -> list[str]:
    """The module, class and function docstrings of ``source`` (cleaned,
    longer than a line's worth), in the order they appear."""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, kinds):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) > 40:
                docs.append(doc)
    return docs


@dataclass(slots=True)
class Corpus:
    """Token streams to draw training windows from (``weights``: the share of
    a batch's windows each gives), the held-out stream, and the standard
    library's digest."""

    streams: dict[str, torch.Tensor]
    weights: dict[str, float]
    heldout: torch.Tensor
    stdlib_sha256: str

    def sample(self, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        """``[batch_size, seq_len + 1]`` windows at random places: each row's
        stream drawn by weight, then a start in it (documents are packed
        back to back, separated by <|endoftext|>)."""
        names = list(self.streams)
        probs = torch.tensor([self.weights[n] for n in names], dtype=torch.float64)
        picks = torch.multinomial(probs, batch_size, replacement=True, generator=gen)
        rows = []
        for i in picks.tolist():
            ids = self.streams[names[i]]
            start = int(torch.randint(0, len(ids) - seq_len - 1, (1,), generator=gen))
            rows.append(ids[start : start + seq_len + 1])
        return torch.stack(rows).long()


def build_corpus(tokenizer_dir: Path, weights: dict[str, float], strict: bool = True) -> Corpus:
    """The streams ``weights`` names (``topics``: the help() pages' training
    part; ``docstrings`` and ``stdlib``: the standard library's), tokenized
    with the tokenizer in ``tokenizer_dir``; every held-out paragraph is
    dropped from them."""
    from paged_server.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tokenizer_dir)
    sep = tok.token_to_id(ENDOFTEXT)
    assert sep is not None, f"{ENDOFTEXT} missing from the default tokenizer"

    def ids(texts: list[str]) -> torch.Tensor:
        out: list[int] = []
        for text in texts:
            out += tok.encode(text, add_special_tokens=False) + [sep]
        return torch.tensor(out, dtype=torch.int32)

    train, heldout = split_texts()
    held = heldout_paragraphs(heldout)
    texts: dict[str, list[str]] = {"topics": train}
    digest = ""
    if {"stdlib", "docstrings"} & set(weights):
        sources, docs, digest = stdlib_texts(strict)
        texts["stdlib"] = [drop_paragraphs(s, held) for s in sources]
        texts["docstrings"] = [drop_paragraphs(d, held) for d in docs]
    unknown = set(weights) - set(texts)
    if unknown:
        raise ValueError(f"unknown corpus streams {sorted(unknown)}; known: {sorted(texts)}")
    streams = {name: ids(texts[name]) for name in weights}
    return Corpus(streams, dict(weights), ids(heldout), digest)
