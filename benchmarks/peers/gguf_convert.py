"""Run llama.cpp's ``convert_hf_to_gguf.py`` with a pre-tokenizer it cannot recognise named.

The converter identifies a BPE tokenizer's pre-tokenizer by hashing how it
splits a test string, against a table of known models; a tokenizer of our
own (the embedded model's byte-level BPE, GPT-2's regex) is in no table, and
the converter stops with "BPE pre-tokenizer was not recognized". Its advice
is to register the hash in its sources; instead this runs it unchanged and
answers the name (``--pre-tokenizer gpt-2``) only where it raised that error.

    python benchmarks/peers/gguf_convert.py LLAMA_CPP_DIR MODEL_DIR [--pre-tokenizer NAME] [converter args]
"""

from __future__ import annotations

import logging
import runpy
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    source, model_dir, *rest = argv
    pre = None
    if "--pre-tokenizer" in rest:
        i = rest.index("--pre-tokenizer")
        pre = rest[i + 1]
        del rest[i : i + 2]
    sys.path[:0] = [source, str(Path(source, "gguf-py"))]  # the converter's own gguf package
    from conversion import base  # type: ignore[import-not-found]

    known = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):  # type: ignore[no-untyped-def]
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            if pre is None:
                raise
            logging.getLogger(__name__).warning("pre-tokenizer not in the converter's table: named %r", pre)
            return pre

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(Path(source, "convert_hf_to_gguf.py")), model_dir, *rest]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
