"""Where a model named on the command line lives: a directory, a GGUF file,
or a Hugging Face id (``Qwen/Qwen3-0.6B``) already downloaded into the local HF cache.

``vllm serve Qwen/Qwen3-0.6B`` downloads; this server never does, but a
checkpoint that ``huggingface-cli download`` (or an earlier vLLM run) put in
the cache is found there, so the same launch line works offline.
"""

from __future__ import annotations

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

