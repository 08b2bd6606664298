"""Which config.json ``architectures`` entries this server can run, and how.

Each entry names the model class, defaults for fields older configs omit,
and how checkpoint weight names map onto the model's (multimodal Gemma 3
checkpoints nest the text model and carry a vision tower we skip).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from paged_server.models.base import CausalLM
from paged_server.models.errors import UnsupportedArchitectureError
from paged_server.models.gemma2 import Gemma2ForCausalLM
from paged_server.models.gemma3 import Gemma3ForCausalLM
from paged_server.models.llama import LlamaForCausalLM
from paged_server.models.mistral import MistralForCausalLM
from paged_server.models.mixtral import MixtralForCausalLM
from paged_server.models.phi3 import Phi3ForCausalLM
from paged_server.models.pooler import POOLING_SUFFIXES, pooling_weight_name
from paged_server.models.qwen2 import Qwen2ForCausalLM
from paged_server.models.qwen3 import Qwen3ForCausalLM
from paged_server.models.qwen3_moe import Qwen3MoeForCausalLM

# Hugging Face's Gemma3TextConfig defaults: released multimodal configs omit these.
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "model_type": "gemma3_text",
    "vocab_size": 262_208,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "tie_word_embeddings": True,
}


@dataclass(frozen=True, slots=True)
class Architecture:
    """How to build one ``architectures`` entry of config.json."""

    model_class: type[CausalLM]
    defaults: dict[str, Any] = field(default_factory=dict)
    text_config_key: str | None = None  # sub-config holding the language model
    renames: tuple[tuple[str, str], ...] = ()  # checkpoint prefix -> model prefix
    skipped_prefixes: tuple[str, ...] = ()  # weights of parts we do not run
    substitutions: tuple[tuple[str, str], ...] = ()  # checkpoint infix -> model infix
    head: str | None = None  # a pooling model's head (models/pooler.py): embed or classify

    def pooling(self, head: str | None) -> Architecture:
        """This architecture run with pooling ``head`` (None: as it is)."""
        return self if head is None else dataclasses.replace(self, head=head)

    def text_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The language model's config dict, with family defaults filled in."""
        text = hf.get(self.text_config_key, {}) if self.text_config_key else hf
        merged = {**self.defaults, **{k: v for k, v in text.items() if v is not None}}
        for key in ("eos_token_id", "bos_token_id"):
            if merged.get(key) is None and hf.get(key) is not None:
                merged[key] = hf[key]
        return merged

    def weight_name(self, checkpoint_name: str) -> str | None:
        """The model parameter a checkpoint tensor fills, or None to skip it."""
        if checkpoint_name.startswith(self.skipped_prefixes) or checkpoint_name.endswith(
            "rotary_emb.inv_freq"
        ):
            return None
        for old, new in self.substitutions:
            checkpoint_name = checkpoint_name.replace(old, new)
        for old, new in self.renames:
            if checkpoint_name.startswith(old):
                checkpoint_name = new + checkpoint_name[len(old) :]
                break
        if self.head is not None:
            return pooling_weight_name(checkpoint_name, self.head)
        return checkpoint_name


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(LlamaForCausalLM),
    "MistralForCausalLM": Architecture(MistralForCausalLM),
    "MixtralForCausalLM": Architecture(
        MixtralForCausalLM, substitutions=((".block_sparse_moe.", ".mlp."),)
    ),
    "Phi3ForCausalLM": Architecture(Phi3ForCausalLM),
    "Qwen2ForCausalLM": Architecture(Qwen2ForCausalLM, defaults={"qkv_bias": True}),
    "Qwen3ForCausalLM": Architecture(Qwen3ForCausalLM),
    "Qwen3MoeForCausalLM": Architecture(Qwen3MoeForCausalLM),
    "Gemma2ForCausalLM": Architecture(
        Gemma2ForCausalLM,
        defaults={"tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh"},
    ),
    "Gemma3ForCausalLM": Architecture(Gemma3ForCausalLM, defaults=_GEMMA3_TEXT_DEFAULTS),
    "Gemma3ForConditionalGeneration": Architecture(
        Gemma3ForCausalLM,
        defaults=_GEMMA3_TEXT_DEFAULTS,
        text_config_key="text_config",
        renames=(
            ("model.language_model.", "model."),  # transformers >= 4.52 layout
            ("language_model.model.", "model."),  # original release layout
            ("language_model.lm_head.", "lm_head."),
        ),
        skipped_prefixes=(
            "vision_tower.",
            "multi_modal_projector.",
            "model.vision_tower.",
            "model.multi_modal_projector.",
        ),
    ),
}

# config.json files without an `architectures` list still name a model_type.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(ARCHITECTURES))


def resolve_architecture(hf: dict[str, Any]) -> tuple[str, Architecture]:
    """The architecture config.json asks for, or an error naming the supported ones."""
    names = list(hf.get("architectures") or [])
    if not names and hf.get("model_type") in _MODEL_TYPES:
        names = [_MODEL_TYPES[hf["model_type"]]]
    for name in names:
        if name in ARCHITECTURES:
            return name, ARCHITECTURES[name]
        for suffix in POOLING_SUFFIXES:  # a family's embedding or classifier save
            base = name.removesuffix(suffix) + "ForCausalLM"
            if name.endswith(suffix) and base in ARCHITECTURES and not ARCHITECTURES[base].text_config_key:
                return name, ARCHITECTURES[base]
    asked = ", ".join(names) if names else f"model_type {hf.get('model_type')!r}"
    raise UnsupportedArchitectureError(
        f"unsupported architecture {asked} in config.json; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
