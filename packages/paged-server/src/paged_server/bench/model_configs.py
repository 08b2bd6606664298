"""Models the benchmark can run: the embedded default model, a ~100M (or ~30M)
parameter random Llama for CPU throughput numbers, or any HF directory.

A random model is created once as a real Hugging Face directory
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
# ~32M: the size the llama.cpp comparison (benchmarks/llamacpp_peer.py) can repeat on 2 cores.
LLAMA_30M: dict[str, Any] = {
    **LLAMA_100M,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 10,
    "num_attention_heads": 8,
}
RANDOM_LLAMAS = {"100m": (LLAMA_100M_NAME, LLAMA_100M), "30m": ("bench-llama-30m-v1", LLAMA_30M)}
SEED = 0
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def ensure_llama_100m(cache_dir: str | Path | None = None) -> Path:
    """The ~100M random Llama's directory, created on first use."""
    return ensure_random_llama("100m", cache_dir)


def ensure_random_llama(size: str, cache_dir: str | Path | None = None) -> Path:
    """The random Llama ``size`` (a key of ``RANDOM_LLAMAS``), created on first
    use (atomic rename, so a crashed or concurrent creation never leaves a
    half-written model)."""
    from paged_server.default_model import default_cache_dir, ensure_default_model

    name, params = RANDOM_LLAMAS[size]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / name
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        _write_random_llama(tmp, ensure_default_model(root), params)
        shutil.rmtree(target, ignore_errors=True)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_random_llama(directory: Path, tokenizer_dir: Path, params: dict[str, Any]) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok_cfg = json.loads((tokenizer_dir / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=tok_cfg["vocab_size"],
        bos_token_id=tok_cfg.get("bos_token_id"),
        eos_token_id=tok_cfg.get("eos_token_id"),
        pad_token_id=tok_cfg.get("pad_token_id"),
        **params,
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
    (``embedded`` = the default model, ``trained`` = the trained evaluation
    model, trained on first use, ``100m`` / ``30m`` = a random Llama)."""
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
    if model_config == "trained":
        from paged_server.default_model.trained import ensure_trained_model

        path = ensure_trained_model()
        return str(path), f"trained-default ({path.name})"
    if model_config in RANDOM_LLAMAS:
        return str(ensure_random_llama(model_config)), f"llama-{model_config} (random, seed 0)"
    raise ValueError(
        f"--model-config must be 'embedded', 'trained', '100m' or '30m', got {model_config!r}"
    )


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
