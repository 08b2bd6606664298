"""The model the server runs when no ``--model`` is given.

A tiny Llama with RANDOM weights (fixed seed) and a real byte-level BPE
tokenizer, written on first use as an ordinary Hugging Face directory so
that it goes through the same loader as any downloaded checkpoint. See
builder.py for its shape.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from paged_server.default_model.builder import write_default_model

DEFAULT_MODEL_NAME = "default-model-v1"  # bump when the builder's output changes
CACHE_ENV = "PAGED_CACHE_DIR"
_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)


def default_cache_dir() -> Path:
    """``$PAGED_CACHE_DIR`` if set, else ``~/.cache/paged``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "paged"


def ensure_default_model(cache_dir: str | Path | None = None) -> Path:
    """The default model's directory, created under ``cache_dir`` (default:
    ``default_cache_dir()``) on first use. Creation writes to a temporary
    directory and renames it into place, so concurrent servers never see a
    half-written model."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / DEFAULT_MODEL_NAME
    if all((target / name).is_file() for name in _FILES):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=root))
    try:
        write_default_model(tmp)
        if target.exists():  # incomplete leftover from a crashed creation
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not all((target / name).is_file() for name in _FILES):
                raise  # not a lost race with another process: a real error
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


__all__ = ["DEFAULT_MODEL_NAME", "default_cache_dir", "ensure_default_model", "write_default_model"]
