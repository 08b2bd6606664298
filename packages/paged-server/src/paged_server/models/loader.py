"""Load a Hugging Face model directory into our model code.

Reads config.json, the weights (one ``*.safetensors`` file or shards listed
in ``model.safetensors.index.json``, memory-mapped with ``safe_open``), the
tokenizer and chat template, and generation_config.json for the EOS ids.
The model is built on the meta device and filled tensor by tensor, so peak
memory is about one copy of the weights in the target dtype.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from paged_server.models.base import CausalLM
from paged_server.models.config import ModelConfig
from paged_server.models.errors import (
    CheckpointMismatchError,
    InvalidConfigError,
    ModelFileNotFoundError,
)
from paged_server.models.registry import Architecture, resolve_architecture
from paged_server.tokenizer import Tokenizer

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(slots=True)
class LoadedModel:
    """Everything the engine needs from a model directory."""

    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    eos_token_ids: list[int]
    path: Path
    dtype: torch.dtype

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's jinja chat template, if it has one."""
        return self.tokenizer.chat_template


def load_model(
    path: str | Path, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu"
) -> LoadedModel:
    """Load the model directory at ``path`` in ``dtype`` (``"auto"``: the
    checkpoint's own) onto ``device``, in eval mode without gradients."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelFileNotFoundError(
            f"model directory {path} does not exist; pass a Hugging Face model directory "
            "(config.json, *.safetensors, tokenizer.json)"
        )
    hf = read_config_json(path)
    arch_name, arch = resolve_architecture(hf)
    config = ModelConfig.from_hf(arch.text_config(hf), arch_name)
    target_dtype = resolve_dtype(dtype, config)
    model = _build_empty(arch, config, target_dtype, torch.device(device))
    load_weights(model, arch, weight_files(path))
    model.eval().requires_grad_(False)
    tokenizer = Tokenizer.from_dir(path)
    eos = eos_token_ids(path, config, tokenizer)
    return LoadedModel(model, config, tokenizer, eos, path, target_dtype)


def read_config_json(path: Path) -> dict[str, Any]:
    """config.json as a dict, with errors that name the file."""
    file = path / "config.json"
    if not file.is_file():
        raise ModelFileNotFoundError(
            f"{file} not found: {path} is not a Hugging Face model directory"
        )
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InvalidConfigError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidConfigError(f"{file} must hold a JSON object")
    return data


def resolve_dtype(dtype: torch.dtype | str, config: ModelConfig) -> torch.dtype:
    """A torch dtype from a dtype, its name, or ``"auto"`` (config.json's)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = (config.torch_dtype or "float32") if dtype == "auto" else dtype
    name = name.removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def weight_files(path: Path) -> list[Path]:
    """The safetensors files holding the weights: the shards the index lists,
    else every ``*.safetensors`` in the directory."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelFileNotFoundError(
                f"{index.name} in {path} lists shards that are not there: {', '.join(missing)}; "
                "the download is incomplete"
            )
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFileNotFoundError(
            f"no *.safetensors weights in {path}; only safetensors checkpoints are supported "
            "(convert .bin/.pt weights with transformers' save_pretrained)"
        )
    return files


def _build_empty(
    arch: Architecture, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> CausalLM:
    """The model with uninitialized weights in ``dtype`` on ``device``."""
    with torch.device("meta"):
        model = arch.model_class(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()  # to_empty gives each module its own tensor
    return model


def load_weights(model: CausalLM, arch: Architecture, files: list[Path]) -> None:
    """Copy every checkpoint tensor into its parameter (converting dtype),
    checking shapes against the model built from config.json."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = arch.weight_name(key)
                if name is None:
                    continue
                if name not in params:
                    if not (name == "lm_head.weight" and model.config.tie_word_embeddings):
                        unexpected.append(key)
                    continue
                param = params[name]
                shape = tuple(f.get_slice(key).get_shape())
                if shape != tuple(param.shape):
                    raise CheckpointMismatchError(
                        f"weight {key} in {file.name} has shape {shape} but config.json implies "
                        f"{tuple(param.shape)} (hidden_size={model.config.hidden_size}, "
                        f"heads={model.config.num_heads}, kv_heads={model.config.num_kv_heads}, "
                        f"head_dim={model.config.head_dim}, vocab_size={model.config.vocab_size}); "
                        "the weights do not belong to this config"
                    )
                with torch.no_grad():
                    param.copy_(f.get_tensor(key))
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise CheckpointMismatchError(
            f"the checkpoint lacks {len(missing)} weights the model needs: {shown}"
        )
    if unexpected:
        log.warning(
            "ignored %d unknown checkpoint tensors, e.g. %s", len(unexpected), unexpected[0]
        )


def eos_token_ids(path: Path, config: ModelConfig, tokenizer: Tokenizer) -> list[int]:
    """Every id that ends generation: generation_config.json's first (what
    the model was tuned to emit), then config.json's, then the tokenizer's."""
    ids: list[int] = []
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        value = json.loads(gen_file.read_text(encoding="utf-8")).get("eos_token_id")
        ids += [value] if isinstance(value, int) else list(value or [])
    ids += config.eos_token_ids
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(int(i) for i in ids))
