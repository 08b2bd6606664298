"""Models the benchmark can run: the embedded default model, a ~100M
parameter random Llama for CPU throughput numbers, or any HF directory.

The 100M model is created once as a real Hugging Face directory
(``LlamaForCausalLM(config).save_pretrained``, fixed seed) under the paged
cache dir, with the embedded model's tokenizer files copied next to it, so
our loader and transformers read the very same weights.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

LLAMA_100M: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 2816,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
LLAMA_100M_NAME = "bench-llama-100m-v1"  # bump when LLAMA_100M or the seed changes
SEED = 0
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def ensure_llama_100m(cache_dir: str | Path | None = None) -> Path:
    """The ~100M random Llama's directory, created on first use (atomic rename,
    so a crashed or concurrent creation never leaves a half-written model)."""
    from paged_server.default_model import default_cache_dir, ensure_default_model

    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / LLAMA_100M_NAME
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{LLAMA_100M_NAME}-", dir=root))
    try:
        _write_llama_100m(tmp, ensure_default_model(root))
        shutil.rmtree(target, ignore_errors=True)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_llama_100m(directory: Path, tokenizer_dir: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok_cfg = json.loads((tokenizer_dir / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=tok_cfg["vocab_size"],
        bos_token_id=tok_cfg.get("bos_token_id"),
        eos_token_id=tok_cfg.get("eos_token_id"),
        pad_token_id=tok_cfg.get("pad_token_id"),
        **LLAMA_100M,
    )
    torch.manual_seed(SEED)
    model: Any = LlamaForCausalLM(config).float()
    model.generation_config = GenerationConfig(
        eos_token_id=tok_cfg.get("eos_token_id"), pad_token_id=tok_cfg.get("pad_token_id")
    )
    model.save_pretrained(directory)
    for name in _TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, directory / name)


def resolve_model(model: str | None, model_config: str) -> tuple[str, str]:
    """``(directory, display name)`` for ``--model DIR`` or ``--model-config``
    (``embedded`` = the default model, ``100m`` = the random ~100M Llama)."""
    from paged_server.default_model import ensure_default_model

    if model is not None:
        if not Path(model, "config.json").is_file():
            raise ValueError(
                f"--model {model}: no config.json there; pass a Hugging Face model directory"
            )
        return model, Path(model).name
    if model_config == "embedded":
        path = ensure_default_model()
        return str(path), f"embedded ({path.name})"
    if model_config == "100m":
        return str(ensure_llama_100m()), "llama-100m (random, seed 0)"
    raise ValueError(f"--model-config must be 'embedded' or '100m', got {model_config!r}")


def count_parameters(model_dir: str) -> int:
    """Parameters stored in the directory's safetensors files (tied weights once)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                n = 1
                for dim in f.get_slice(key).get_shape():
                    n *= dim
                total += n
    return total
