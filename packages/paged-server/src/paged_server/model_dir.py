"""Where a model named on the command line lives: a directory, a GGUF file,
or a Hugging Face id (``Qwen/Qwen3-0.6B``) already downloaded into the local HF cache.

``vllm serve Qwen/Qwen3-0.6B`` downloads; this server never does, but a
checkpoint that ``huggingface-cli download`` (or an earlier vLLM run) put in
the cache is found there, so the same launch line works offline.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def hf_hub_cache() -> Path:
    """The HF hub cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def resolve_model_dir(model: str) -> str:
    """``model`` itself when it is a directory or a file (or does not look like a
    hub id); else the cached snapshot of that hub id (``refs/main``, or the only
    snapshot). Raises ``FileNotFoundError`` saying what was looked for."""
    path = Path(model).expanduser()
    local = path.exists() or model.lower().endswith(".gguf")  # a .gguf names a file, never a hub id
    if local or model.startswith((".", "/", "~")) or model.count("/") != 1:
        return model
    repo = hf_hub_cache() / ("models--" + model.replace("/", "--"))
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
        return str(snapshots / ref.read_text().strip())
    found = sorted(snapshots.iterdir()) if snapshots.is_dir() else []
    if len(found) == 1:
        return str(found[0])
    raise FileNotFoundError(
        f"model: {model} is not a directory and not in the Hugging Face cache ({repo}); "
        "paged-server downloads nothing: run `huggingface-cli download "
        f"{model}` first, or pass the checkpoint's directory"
    )


def checkpoint_dtype(model_dir: str) -> str | None:
    """The dtype config.json names (``torch_dtype``, or transformers 5's
    ``dtype``; a nested ``text_config``'s too), e.g. ``"bfloat16"``; a GGUF
    file's from its file type."""
    from paged_server.models.gguf import GGUFFile, is_gguf

    if is_gguf(model_dir):
        try:
            return GGUFFile(model_dir).dtype()
        except (OSError, ValueError):
            return None  # the loader says what is wrong with the file
    try:
        with open(Path(model_dir) / "config.json", encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    for scope in (config, config.get("text_config") or {}):
        value = scope.get("torch_dtype") or scope.get("dtype")
        if isinstance(value, str):
            return value.removeprefix("torch.")
    return None
