"""Load a Hugging Face model directory (or a GGUF file) into our model code,
and read the dtype a checkpoint names (``--dtype auto``).

Reads config.json, the weights (one ``*.safetensors`` file or shards listed
in ``model.safetensors.index.json``, memory-mapped with ``safe_open``), the
tokenizer and chat template, and generation_config.json for the EOS ids.
The model is built on the meta device and filled tensor by tensor, so peak
memory is about one copy of the weights in the target dtype. With tensor
parallelism each rank reads only its slices of the sharded weights
(``safe_open(...).get_slice``), so no rank holds the whole model; with
pipeline parallelism each stage reads only its layers' tensors. A GGUF
file (llama.cpp's) loads through the same steps: gguf.py reads its config,
gguf_tensors.py names and decodes its tensors, gguf_tokenizer.py builds
its tokenizer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection
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
from paged_server.models.gguf import GGUFFile, gguf_pooling, is_gguf, read_gguf_config
from paged_server.models.gguf_tensors import MAPPED_TYPES, GGUFTensors
from paged_server.models.gguf_tokenizer import eos_token_ids as gguf_eos_token_ids
from paged_server.models.gguf_tokenizer import gguf_tokenizer
from paged_server.models.linear import Part
from paged_server.models.moe import Experts
from paged_server.models.pipeline_parallel import WHOLE, PipelineStage
from paged_server.models.pooler import PoolerConfig, attach_head, read_pooler_config
from paged_server.models.quantization import (
    Quantization,
    load_quantized_layers,
    quantize_layers,
    resolve_quantization,
)
from paged_server.models.quantization.load import quantizable_layers, swap_quantized
from paged_server.models.quantization.methods import GGUF
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
    quantization: Quantization | None = None  # the weight format, when not dense
    pooler: PoolerConfig | None = None  # a pooling model's (--runner pooling) head and pooling

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's jinja chat template, if it has one."""
        return self.tokenizer.chat_template


def load_model(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    tp: TensorParallel = SINGLE,
    quantization: str | None = None,
    pp: PipelineStage = WHOLE,
    pooling: str | None = None,
    pooler_config: dict[str, Any] | None = None,
) -> LoadedModel:
    """Load the model directory at ``path`` in ``dtype`` (``"auto"``: the
    checkpoint's own) onto ``device``, in eval mode without gradients; with
    ``tp``, only that rank's shard; with ``pp``, only that stage's layers. A quantized checkpoint loads in its
    format; ``quantization`` (vLLM's ``--quantization``) may name it, or
    quantize 16/32-bit weights at load (``fp8``, ``int8``, ``int4``). A
    ``.gguf`` file loads in its own formats (``quantization``: None or ``gguf``).
    ``pooling`` (``embed``/``classify``, ``models.pooler.resolve_head``)
    loads it as a pooling model, ``pooler_config`` (vLLM's) over its own pooling."""
    path = Path(path).expanduser()
    hf, config, arch = _read_model_config(path)
    target_dtype = resolve_dtype(dtype, config)
    if is_gguf(path):
        if pooling == "classify":
            raise InvalidConfigError(
                "a GGUF file pools as an embedding model only (it holds no classifier head); "
                "serve the Hugging Face directory for --convert classify"
            )
        return _load_gguf(
            path, config, arch.pooling(pooling), target_dtype, torch.device(device), tp,
            quantization, pp, pooler_config if pooling else None,
        )  # fmt: skip
    quant = resolve_quantization(hf, quantization)
    arch = arch.pooling(pooling)
    model = _build_empty(arch, config, target_dtype, torch.device(device), tp, pp)
    pooler = None
    if pooling is not None:
        pooler = read_pooler_config(path, hf, pooling, pooler_config)
        attach_head(model, pooler, target_dtype, torch.device(device))
    if quant is not None and any(isinstance(m, Experts) for m in model.modules()):
        raise InvalidConfigError(
            f"{quant.name} weights are not supported for mixture-of-experts models "
            f"({config.architecture}) yet; serve an unquantized checkpoint"
        )
    files = weight_files(path)
    consumed, bytes_read = set(), 0
    if quant is not None and not quant.online:
        consumed, bytes_read = load_quantized_layers(model, arch, files, quant)
    bytes_read += load_weights(model, arch, files, skip=consumed)
    if quant is not None and quant.online:
        quantize_layers(model, quant)
    model.eval().requires_grad_(False)
    tokenizer = Tokenizer.from_dir(path)
    eos = eos_token_ids(path, config, tokenizer)
    return LoadedModel(model, config, tokenizer, eos, path, target_dtype, bytes_read, quant, pooler)


def checkpoint_dtype(model_dir: str) -> str | None:
    """The dtype config.json names (``torch_dtype``, or transformers 5's
    ``dtype``; a nested ``text_config``'s too), e.g. ``"bfloat16"``; a GGUF
    file's from its file type."""
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


def read_model_config(path: str | Path) -> ModelConfig:
    """The model's config from its directory's config.json, without loading
    weights (to check settings against it first)."""
    return _read_model_config(Path(path).expanduser())[1]


def _read_model_config(path: Path) -> tuple[dict[str, Any], ModelConfig, Architecture]:
    if is_gguf(path):
        return read_gguf_config(path)
    if not path.is_dir():
        raise ModelFileNotFoundError(
            f"model directory {path} does not exist; pass a Hugging Face model directory "
            "(config.json, *.safetensors, tokenizer.json) or a .gguf file"
        )
    hf = read_config_json(path)
    arch_name, arch = resolve_architecture(hf)
    return hf, ModelConfig.from_hf(arch.text_config(hf), arch_name), arch


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
    pp: PipelineStage = WHOLE,
) -> CausalLM:
    """The model (``tp``'s shard of ``pp``'s stage) with uninitialized
    weights in ``dtype`` on ``device``."""
    with torch.device("meta"):
        model = arch.model_class(config, tp, pp)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()  # to_empty gives each module its own tensor
    return model


def load_weights(
    model: CausalLM,
    arch: Architecture,
    files: list[Path],
    skip: Collection[str] = (),
    opener: Callable[[Path], Any] | None = None,
) -> int:
    """Copy every checkpoint tensor, or the slice of it this rank holds, into
    its parameter (converting dtype), checking shapes against the model built
    from config.json. Where each tensor goes is ``checkpoint_targets``'
    answer (stacked q/k/v and gate/up included); ``skip``: keys already
    loaded (quantized layers); ``opener``: what opens a file (``safe_open``,
    or a GGUF file's tensors). Returns the bytes read from the files."""
    targets = checkpoint_targets(model)
    tied = model.config.tie_word_embeddings
    bytes_read = 0
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with (opener or _open_weights)(file) as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = arch.weight_name(key)
                if name is None or key in skip:
                    continue
                if name not in targets:
                    tied_head = name == "lm_head.weight" and tied
                    if not tied_head and model.pp.holds_weight(name, tied):  # else another stage's
                        unexpected.append(key)
                    continue
                tensor_slice = f.get_slice(key)
                shape = tuple(tensor_slice.get_shape())
                for param, part in targets[name]:
                    dest = param if part.index is None else param[part.index]
                    expected = tuple(dest.shape)
                    if part.dim is not None:  # the full tensor's shape, this rank's slice of it
                        expected = expected[: part.dim] + (part.full,) + expected[part.dim + 1 :]
                    if shape != expected:
                        raise CheckpointMismatchError(
                            f"weight {key} in {file.name} has shape {shape} but config.json "
                            f"implies {expected} (hidden_size={model.config.hidden_size}, "
                            f"heads={model.config.num_heads}, "
                            f"kv_heads={model.config.num_kv_heads}, "
                            f"head_dim={model.config.head_dim}, "
                            f"vocab_size={model.config.vocab_size}); "
                            "the weights do not belong to this config"
                        )
                    if part.dim is None:
                        tensor = f.get_tensor(key)
                    else:
                        index = (slice(None),) * part.dim + (
                            slice(part.start, part.start + part.size),
                        )
                        tensor = tensor_slice[index]
                        dest = dest.narrow(part.dim, part.offset, part.size)
                    bytes_read += tensor.numel() * tensor.element_size()
                    with torch.no_grad():
                        dest.copy_(tensor)
                loaded.add(name)
    missing = sorted(set(targets) - loaded)
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


def _load_gguf(
    path: Path,
    config: ModelConfig,
    arch: Architecture,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel,
    quantization: str | None,
    pp: PipelineStage,
    pooler_config: dict[str, Any] | None = None,
) -> LoadedModel:
    """``load_model`` for a GGUF file: Q8_0/Q4_0 linear layers become int8/int4
    weights in groups of 32, every other tensor loads dense (gguf_tensors.py).
    An ``arch`` with a pooling head (embeddings only) loads without the LM
    head, pooled as the file's ``pooling_type`` says (``gguf_pooling``)."""
    file = GGUFFile(path)
    if quantization not in (None, GGUF):
        raise InvalidConfigError(
            f"quantization={quantization!r}: a GGUF file loads in its own formats; drop "
            "--quantization (or pass gguf)"
        )
    model = _build_empty(arch, config, dtype, device, tp, pp)
    meta = _build_empty(arch, config, dtype, torch.device("meta"))
    pooler = None
    if arch.head is not None:
        override = pooler_config or {}
        own = {} if "pooling_type" in override else gguf_pooling(file)
        pooler = read_pooler_config(None, {}, arch.head, {**own, **override})
        attach_head(model, pooler, dtype, device)
        attach_head(meta, pooler, dtype, torch.device("meta"))
    # Every layer's names, not only this stage's: load_weights tells the other stages' apart.
    names = checkpoint_targets(meta)
    tensors = GGUFTensors(file, names, config.num_heads, config.num_kv_heads)
    quantized = {
        layer: weight
        for layer in quantizable_layers(model)
        if f"{layer}.weight" in tensors.gguf_name
        and (weight := tensors.quantized(f"{layer}.weight")) is not None
    }
    swapped = swap_quantized(model, quantized, partial_ok=True)
    consumed = {f"{layer}.weight" for layer in swapped}
    bytes_read = sum(tensors.nbytes(key) for key in consumed)
    bytes_read += load_weights(model, arch, [path], skip=consumed, opener=lambda _: tensors)
    tensors.log_dequantized()
    model.eval().requires_grad_(False)
    quant = None
    if swapped:
        kinds = sorted({tensors.type_of(key) for key in consumed})
        ours = "/".join(f"int{MAPPED_TYPES[k]}" for k in kinds)
        quant = Quantization(GGUF, f"GGUF {'/'.join(kinds)} ({ours} g32)")
    tokenizer = gguf_tokenizer(file)
    eos = list(dict.fromkeys([*gguf_eos_token_ids(file), *config.eos_token_ids]))
    return LoadedModel(model, config, tokenizer, eos, path, dtype, bytes_read, quant, pooler)


def _open_weights(file: Path) -> Any:
    """``safe_open`` with an error that names the file when it is damaged."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except SafetensorError as exc:
        raise CorruptCheckpointError(
            f"{file} is not a readable safetensors file ({exc}); it is probably truncated "
            "(an interrupted download or a full disk): download it again"
        ) from None


def checkpoint_targets(model: CausalLM) -> dict[str, list[tuple[torch.Tensor, Part]]]:
    """Checkpoint tensor name (after the architecture's renames) -> the
    parameters it fills and how (``linear.Part``; several when one tensor
    holds stacked projections this rank keeps slices of). Layers that know
    their checkpoint tensors (``checkpoint_tensors``: the projections,
    stacked or sharded, and the experts) answer for their parameters; every
    other parameter (embeddings, norms, the LM head) is filled whole from
    the tensor of its own name."""
    targets: dict[str, list[tuple[torch.Tensor, Part]]] = {}
    claimed: set[str] = set()
    for prefix, module in model.named_modules():
        describe = getattr(module, "checkpoint_tensors", None)
        if describe is None:
            continue
        parent, _, own = prefix.rpartition(".")
        for name, part in describe(own):
            key = f"{parent}.{name}" if parent else name
            targets.setdefault(key, []).append((getattr(module, part.param), part))
            claimed.add(f"{prefix}.{part.param}")
    for name, param in model.named_parameters():
        if name not in claimed:
            targets[name] = [(param, Part(name.rpartition(".")[2]))]
    return targets


def checkpoint_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under their checkpoint names (stacked q/k/v and
    gate/up cut back into their projections): what ``load_weights`` reads,
    for writing a checkpoint of a one-rank model (``default_model.train``)."""
    out: dict[str, torch.Tensor] = {}
    for name, pieces in checkpoint_targets(model).items():
        pieces = sorted(pieces, key=lambda piece: piece[1].start)
        first = pieces[0][1]
        held = sum(part.size for _, part in pieces)
        assert first.dim is None or held == first.full, (
            f"{name}: this rank holds a slice; save from a one-rank model"
        )
        tensors = []
        for param, part in pieces:
            src = param if part.index is None else param[part.index]
            tensors.append(src if part.dim is None else src.narrow(part.dim, part.offset, part.size))
        out[name] = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=first.dim or 0)
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
