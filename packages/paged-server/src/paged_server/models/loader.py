"""Load a Hugging Face model directory into our model code.

Reads config.json, the weights (one ``*.safetensors`` file or shards listed
in ``model.safetensors.index.json``, memory-mapped with ``safe_open``), the
tokenizer and chat template, and generation_config.json for the EOS ids.
The model is built on the meta device and filled tensor by tensor, so peak
memory is about one copy of the weights in the target dtype. With tensor
parallelism each rank reads only its slices of the sharded weights
(``safe_open(...).get_slice``), so no rank holds the whole model.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from paged_server.models.base import CausalLM
from paged_server.models.config import ModelConfig
from paged_server.models.errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    InvalidConfigError,
    ModelFileNotFoundError,
)
from paged_server.models.registry import Architecture, resolve_architecture
from paged_server.models.tensor_parallel import SINGLE, TensorParallel
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
    bytes_read: int = 0  # checkpoint bytes this process read (its shard with TP)

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's jinja chat template, if it has one."""
        return self.tokenizer.chat_template


def load_model(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    tp: TensorParallel = SINGLE,
) -> LoadedModel:
    """Load the model directory at ``path`` in ``dtype`` (``"auto"``: the
    checkpoint's own) onto ``device``, in eval mode without gradients; with
    ``tp``, only that rank's shard."""
    path = Path(path).expanduser()
    config, arch = _read_model_config(path)
    target_dtype = resolve_dtype(dtype, config)
    model = _build_empty(arch, config, target_dtype, torch.device(device), tp)
    bytes_read = load_weights(model, arch, weight_files(path))
    model.eval().requires_grad_(False)
    tokenizer = Tokenizer.from_dir(path)
    eos = eos_token_ids(path, config, tokenizer)
    return LoadedModel(model, config, tokenizer, eos, path, target_dtype, bytes_read)


def read_model_config(path: str | Path) -> ModelConfig:
    """The model's config from its directory's config.json, without loading
    weights (to check settings against it first)."""
    return _read_model_config(Path(path).expanduser())[0]


def _read_model_config(path: Path) -> tuple[ModelConfig, Architecture]:
    if not path.is_dir():
        raise ModelFileNotFoundError(
            f"model directory {path} does not exist; pass a Hugging Face model directory "
            "(config.json, *.safetensors, tokenizer.json)"
        )
    hf = read_config_json(path)
    arch_name, arch = resolve_architecture(hf)
    return ModelConfig.from_hf(arch.text_config(hf), arch_name), arch


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
    arch: Architecture,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel = SINGLE,
) -> CausalLM:
    """The model (``tp``'s shard of it) with uninitialized weights in ``dtype`` on ``device``."""
    with torch.device("meta"):
        model = arch.model_class(config, tp)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()  # to_empty gives each module its own tensor
    return model


def load_weights(model: CausalLM, arch: Architecture, files: list[Path]) -> int:
    """Copy every checkpoint tensor, or the slice of it this rank holds, into
    its parameter (converting dtype), checking shapes against the model built
    from config.json. Returns the bytes read from the files."""
    params = dict(model.named_parameters())
    shards = _shard_slices(model)
    bytes_read = 0
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with _open_weights(file) as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = arch.weight_name(key)
                if name is None:
                    continue
                if name not in params:
                    if not (name == "lm_head.weight" and model.config.tie_word_embeddings):
                        unexpected.append(key)
                    continue
                param = params[name]
                tensor_slice = f.get_slice(key)
                shape = tuple(tensor_slice.get_shape())
                expected = tuple(param.shape)
                shard = shards.get(name)
                if shard is not None:  # the full tensor's shape, this rank's slice of it
                    dim, start, full = shard
                    expected = expected[:dim] + (full,) + expected[dim + 1 :]
                if shape != expected:
                    raise CheckpointMismatchError(
                        f"weight {key} in {file.name} has shape {shape} but config.json implies "
                        f"{expected} (hidden_size={model.config.hidden_size}, "
                        f"heads={model.config.num_heads}, kv_heads={model.config.num_kv_heads}, "
                        f"head_dim={model.config.head_dim}, vocab_size={model.config.vocab_size}); "
                        "the weights do not belong to this config"
                    )
                if shard is None:
                    tensor = f.get_tensor(key)
                else:
                    dim, start, _ = shard
                    index = (slice(None),) * dim + (slice(start, start + param.shape[dim]),)
                    tensor = tensor_slice[index]
                bytes_read += tensor.numel() * tensor.element_size()
                with torch.no_grad():
                    param.copy_(tensor)
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
    return bytes_read


def _open_weights(file: Path) -> Any:
    """``safe_open`` with an error that names the file when it is damaged."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except SafetensorError as exc:
        raise CorruptCheckpointError(
            f"{file} is not a readable safetensors file ({exc}); it is probably truncated "
            "(an interrupted download or a full disk): download it again"
        ) from None


def _shard_slices(model: CausalLM) -> dict[str, tuple[int, int, int]]:
    """``param name -> (dim, start, full size)`` for the parameters a rank
    holds a slice of (the tensor-parallel layers'); others are read whole.
    A row-parallel layer's bias is whole."""
    out: dict[str, tuple[int, int, int]] = {}
    if model.tp.world_size == 1:
        return out
    for prefix, module in model.named_modules():
        dim = getattr(module, "shard_dim", None)
        if dim is None:
            continue
        spec = (dim, module.shard_start, module.full_size)
        out[f"{prefix}.weight"] = spec
        if dim == 0 and getattr(module, "bias", None) is not None:
            out[f"{prefix}.bias"] = (0, module.shard_start, module.full_size)
    return out


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
