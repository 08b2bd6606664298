"""A GGUF file (llama.cpp's format) read as a Hugging Face checkpoint.

``--model file.gguf`` loads through the same path as a model directory:
the file's ``<arch>.*`` metadata becomes a config.json-shaped dict (so
``ModelConfig.from_hf`` and the architecture registry apply unchanged),
and its tensors are named back to Hugging Face's names with the table
llama.cpp's own converter uses (``gguf.get_tensor_name_map``), run
backwards over the names our model asks for. gguf_reader.py reads the
file, gguf_tensors.py decodes the tensors (with the ``gguf`` package),
gguf_tokenizer.py builds the tokenizer.
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from paged_server.models.config import ModelConfig
from paged_server.models.errors import (
    CorruptCheckpointError,
    InvalidConfigError,
    ModelFileNotFoundError,
    UnsupportedArchitectureError,
)
from paged_server.models.gguf_reader import GGUFTensor, read_gguf
from paged_server.models.registry import Architecture, resolve_architecture

# general.architecture -> our class (llama.cpp writes Mistral as "llama").
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# general.file_type (llama_ftype) -> the dtype ``--dtype auto`` takes (16-bit for
# the block formats: their scales are f16).
_FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (a file whose name ends in .gguf)."""
    path = Path(path).expanduser()
    return path.suffix.lower() == ".gguf" and not path.is_dir()


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime_ns: int) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    try:
        return read_gguf(path)
    except (ValueError, IndexError, struct.error, UnicodeDecodeError, OSError) as exc:
        raise CorruptCheckpointError(
            f"{path} is not a readable GGUF file ({exc}); it is probably truncated "
            "(an interrupted download or a full disk): download it again"
        ) from None


class GGUFFile:
    """One GGUF file: its metadata (``value``) and tensors (``tensors``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ModelFileNotFoundError(f"GGUF file {self.path} does not exist")
        # Parsed once per file version: the engine reads the config, then loads.
        self.metadata, self.tensors = _open(str(self.path), os.stat(self.path).st_mtime_ns)
        self.arch = str(self.value("general.architecture", ""))
        if int(self.value("split.count", 1) or 1) > 1:
            raise InvalidConfigError(
                f"{self.path.name} is part {int(self.value('split.no', 0)) + 1} of "
                f"{self.value('split.count')} of a split GGUF; merge the parts into one file first "
                f"(llama.cpp: llama-gguf-split --merge {self.path.name} merged.gguf)"
            )

    def value(self, key: str, default: Any = None) -> Any:
        """The metadata value of ``key`` (a list for arrays), or ``default``."""
        return self.metadata.get(key, default)

    def arch_value(self, key: str, default: Any = None) -> Any:
        """``<arch>.<key>``, the architecture's own metadata."""
        return self.value(f"{self.arch}.{key}", default)

    @property
    def architecture(self) -> str:
        """Our class for the file's architecture, or a refusal naming it."""
        if self.arch not in ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"GGUF architecture {self.arch!r} in {self.path.name} is not supported; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        return ARCHITECTURES[self.arch]

    def dtype(self) -> str:
        """The dtype name ``--dtype auto`` takes for this file."""
        return _FILE_DTYPES.get(int(self.value("general.file_type", 1)), "float16")

    def hf_config(self) -> dict[str, Any]:
        """The metadata as the config.json of the checkpoint it was converted from."""
        arch = self.architecture
        hidden = self._required("embedding_length")
        heads = self._required("attention.head_count")
        embed = self.tensors.get("token_embd.weight")
        vocab = self.arch_value("vocab_size") or (
            int(embed.shape[1])
            if embed is not None
            else len(self.value("tokenizer.ggml.tokens", []))
        )
        config: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.arch,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": self._required("feed_forward_length"),
            "num_hidden_layers": self._required("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._uniform("attention.head_count_kv", heads),
            "head_dim": int(self.arch_value("attention.key_length") or hidden // heads),
            "max_position_embeddings": int(self.arch_value("context_length", 2048)),
            "rms_norm_eps": _f32(self.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": _f32(self.arch_value("rope.freq_base", 10_000.0)),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_output.bias" in self.tensors,
            "torch_dtype": self.dtype(),
        }
        config["qkv_bias"] = "blk.0.attn_q.bias" in self.tensors
        config.update(self._rope_scaling())
        for ours, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
            if (value := self.value(f"tokenizer.ggml.{key}")) is not None:
                config[ours] = int(value)
        return config

    def adjust(self, config: ModelConfig) -> ModelConfig:
        """What config.json cannot say: Llama 3's RoPE scaling, which the
        converter stores as per-frequency factors (``rope_freqs.weight``)."""
        factors = self.tensors.get("rope_freqs.weight")
        if factors is None:
            return config
        values = torch.from_numpy(factors.data.copy()).float().tolist()
        if len(values) != config.head_dim // 2:
            raise InvalidConfigError(
                f"rope_freqs.weight in {self.path.name} has {len(values)} factors but head_dim "
                f"{config.head_dim} needs {config.head_dim // 2}; the file is damaged"
            )
        return replace(config, rope=replace(config.rope, freq_factors=values))

    def _required(self, key: str) -> int:
        value = self.arch_value(key)
        if value is None:
            raise InvalidConfigError(
                f"{self.path.name} has no {self.arch}.{key} metadata, which a {self.arch} model "
                "needs; the file is incomplete or not a language model"
            )
        return int(value)

    def _uniform(self, key: str, default: int) -> int:
        """A per-model count some files store per layer (all layers alike here)."""
        value = self.arch_value(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise InvalidConfigError(
                    f"{self.path.name}: {self.arch}.{key} differs between layers ({value[:8]}...); "
                    "per-layer head counts are not supported"
                )
            value = value[0]
        return int(value)

    def _rope_scaling(self) -> dict[str, Any]:
        kind = self.arch_value("rope.scaling.type")
        if kind in (None, "none"):
            return {}
        if kind == "linear":
            return {
                "rope_scaling": {
                    "rope_type": "linear",
                    "factor": _f32(self.arch_value("rope.scaling.factor")),
                }
            }
        raise InvalidConfigError(
            f"{self.path.name} uses {kind!r} RoPE scaling ({self.arch}.rope.scaling.type), which is "
            "not supported for GGUF files; supported: none, linear, Llama 3's (rope_freqs)"
        )


def _f32(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(f"{float(value):.7g}")


# llama.cpp's <arch>.pooling_type (enum llama_pooling_type) -> ours; NONE: the default
_GGUF_POOLING = {1: "MEAN", 2: "CLS", 3: "LAST"}


def gguf_pooling(file: GGUFFile) -> dict[str, Any]:
    """The pooling an embedding GGUF declares (llama.cpp's converter writes
    ``<arch>.pooling_type`` from the model's sentence-transformers files), as
    a ``--pooler-config`` entry; none declared: {} (the last token)."""
    kind = file.arch_value("pooling_type")
    if kind is None or int(kind) == 0:
        return {}
    if int(kind) not in _GGUF_POOLING:
        raise InvalidConfigError(
            f"{file.path.name}: pooling_type {int(kind)} (llama.cpp's rank pooling) is not supported; "
            "serve the Hugging Face directory, or pass --pooler-config with a pooling_type"
        )
    return {"pooling_type": _GGUF_POOLING[int(kind)]}


def read_gguf_config(path: str | Path) -> tuple[dict[str, Any], ModelConfig, Architecture]:
    """The config.json-shaped dict, ``ModelConfig`` and architecture of a
    GGUF file; a tensor type we cannot load is refused here, before loading."""
    from paged_server.models.gguf_tensors import check_types

    file = GGUFFile(path)
    check_types(file)
    hf = file.hf_config()
    name, arch = resolve_architecture(hf)
    return hf, file.adjust(ModelConfig.from_hf(arch.text_config(hf), name)), arch
