"""A LoRA adapter directory in PEFT's format, read and checked.

``adapter_config.json`` is read with the fields of ``peft``'s
``LoraConfig`` (``r``, ``lora_alpha``, ``use_rslora``, ``rank_pattern``,
``alpha_pattern``, ``target_modules``); ``adapter_model.safetensors`` (or
PEFT's older ``adapter_model.bin``) holds ``base_model.model.<module>.
lora_A.weight [r, in]`` and ``lora_B.weight [out, r]`` per adapted
projection. A module's delta is ``B @ A @ x * scaling``, ``scaling =
alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), ``r`` and ``alpha`` taken
from the patterns first, as PEFT does.

What would serve other outputs than PEFT's model is refused here, with the
field that asks for it: DoRA and the other LoRA variants, trained biases,
``modules_to_save``, trainable tokens, adapters on the embeddings or the LM
head, and non-LoRA PEFT types. Whether the modules exist in the model and
the ranks fit ``max_lora_rank`` is the slot table's check
(``lora/layers.py``), which knows the model.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from paged_server.models.errors import LoRAAdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
PREFIX = "base_model.model."  # what PEFT's save_pretrained puts before the model's names
EMBEDDING_MODULES = ("embed_tokens", "lm_head")
# LoraConfig fields that change the forward pass beyond B @ A: refused when set.
UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "modules_to_save": "whole modules saved with the adapter (modules_to_save)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "target_parameters": "adapted parameters (target_parameters, e.g. experts)",
    "layer_replication": "replicated layers (layer_replication)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
}


@dataclass(frozen=True, slots=True)
class LoRAAdapterConfig:
    """What a served adapter needs from ``adapter_config.json``: rank and
    alpha (with per-module patterns), rsLoRA, and the modules it targets
    (a list of names, a regex, or ``all-linear``)."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str | None = None
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_model_name_or_path: str | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str) -> LoRAAdapterConfig:
        """The config of ``raw`` (adapter_config.json's object), or an error
        naming the field that asks for something this server cannot serve."""
        peft_type = raw.get("peft_type", "LORA")
        if str(peft_type).upper() != "LORA":
            raise LoRAAdapterError(
                f"{where} is a {peft_type} adapter; only LoRA adapters (peft_type LORA) can be served"
            )
        for name, what in UNSUPPORTED.items():
            if raw.get(name):
                raise LoRAAdapterError(
                    f"{where} uses {what}, which is not supported; serve a plain LoRA adapter, "
                    "or merge this one into the base model (peft's merge_and_unload)"
                )
        bias = raw.get("bias", "none")
        if bias != "none":
            raise LoRAAdapterError(
                f"{where} trains biases (bias={bias!r}); only adapters with bias='none' are supported"
            )
        targets = raw.get("target_modules")
        if isinstance(targets, list):
            targets = tuple(targets)
            embedding = [t for t in targets if t in EMBEDDING_MODULES]
            if embedding:
                raise LoRAAdapterError(
                    f"{where} adapts {', '.join(embedding)}; adapters on the embeddings or the LM "
                    "head are not supported (target the attention and MLP projections only)"
                )
        r, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)  # LoraConfig's defaults
        if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
            raise LoRAAdapterError(f"{where}: r must be a positive integer, got {r!r}")
        if not isinstance(alpha, int | float) or isinstance(alpha, bool):
            raise LoRAAdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
        return cls(
            r=r,
            lora_alpha=float(alpha),
            target_modules=targets,
            use_rslora=bool(raw.get("use_rslora", False)),
            rank_pattern=dict(raw.get("rank_pattern") or {}),
            alpha_pattern=dict(raw.get("alpha_pattern") or {}),
            base_model_name_or_path=raw.get("base_model_name_or_path"),
        )

    def scaling(self, module: str) -> float:
        """The factor on ``module``'s delta (its Hugging Face name, e.g.
        ``model.layers.0.self_attn.q_proj``): ``alpha / r``, or ``alpha /
        sqrt(r)`` with rsLoRA, each from its pattern if one matches."""
        r = self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r)
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.lora_alpha)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern_key(patterns: dict[str, Any], module: str) -> str:
    """The first pattern matching ``module``'s name or a dotted suffix of it
    (peft's ``get_pattern_key``), else the name itself (no pattern)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter read from disk: its name, directory, config, and each
    adapted module's ``(A [r, in], B [out, r])`` on the CPU, keyed by the
    module's Hugging Face name."""

    name: str
    path: Path
    config: LoRAAdapterConfig
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def rank(self) -> int:
        """The largest rank of any adapted module."""
        return max(a.shape[0] for a, _ in self.weights.values())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter(name: str, path: str | Path) -> LoRAAdapter:
    """The adapter in directory ``path``, checked for what this server can
    serve (not yet against a model: ``LoRAWeights`` does that)."""
    path = Path(path).expanduser()
    where = f"LoRA adapter {name!r} ({path})"
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise LoRAAdapterError(
            f"{where}: no {CONFIG_FILE}; pass a directory saved by peft's save_pretrained"
        )
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoRAAdapterError(f"{where}: {CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise LoRAAdapterError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    config = LoRAAdapterConfig.from_dict(raw, where)
    weights = _pair_up(_read_tensors(path, where), where)
    if not weights:
        raise LoRAAdapterError(f"{where}: the weights file holds no lora_A/lora_B tensors")
    return LoRAAdapter(name, path, config, weights)


def adapter_digest(path: str | Path) -> bytes:
    """A digest of the adapter's config and weights files: what its KV
    depends on, so the prefix cache keeps one adapter's blocks from another's
    (an adapter loaded again with other weights, under the same name, too)."""
    path = Path(path).expanduser()
    h = hashlib.blake2b(digest_size=16)
    for file_name in (CONFIG_FILE, *WEIGHT_FILES):
        file = path / file_name
        if file.is_file():
            h.update(file_name.encode() + b"\0")
            with file.open("rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
    return h.digest()


def _read_tensors(path: Path, where: str) -> dict[str, torch.Tensor]:
    for file_name in WEIGHT_FILES:
        file = path / file_name
        if not file.is_file():
            continue
        try:
            if file.suffix == ".safetensors":
                return load_file(str(file), device="cpu")
            tensors = torch.load(file, map_location="cpu", weights_only=True)
        except (SafetensorError, RuntimeError, OSError) as exc:
            raise LoRAAdapterError(
                f"{where}: {file_name} cannot be read ({exc}); it is probably truncated: copy it again"
            ) from None
        if not isinstance(tensors, dict):
            raise LoRAAdapterError(f"{where}: {file_name} does not hold a dict of tensors")
        return tensors
    raise LoRAAdapterError(f"{where}: no {' or '.join(WEIGHT_FILES)} in the directory")


def _pair_up(
    tensors: dict[str, torch.Tensor], where: str
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``module -> (A, B)`` from PEFT's flat names, refusing tensors that
    are not plain LoRA factors of a linear layer."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(PREFIX)
        owner = name.split(".lora_")[0]
        if ".lora_embedding_" in name or owner.rpartition(".")[2] in EMBEDDING_MODULES:
            raise LoRAAdapterError(
                f"{where} adapts {owner}; adapters on the embeddings or the LM head are not "
                "supported"
            )
        if ".lora_magnitude_vector" in name:
            raise LoRAAdapterError(f"{where} holds DoRA magnitudes ({key}); DoRA is not supported")
        match = re.fullmatch(r"(.+)\.lora_(A|B)\.weight", name)
        if match is None:
            raise LoRAAdapterError(
                f"{where}: unexpected tensor {key}; a LoRA adapter holds only "
                "<module>.lora_A.weight and <module>.lora_B.weight"
            )
        module, which = match.groups()
        if tensor.dim() != 2:
            raise LoRAAdapterError(f"{where}: {key} has shape {tuple(tensor.shape)}, not 2-D")
        found.setdefault(module, {})[which] = tensor
    out = {}
    for module, pair in found.items():
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAAdapterError(f"{where}: {module} has no {missing}.weight")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != b.shape[1]:
            raise LoRAAdapterError(
                f"{where}: {module}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                "disagree on the rank"
            )
        out[module] = (a, b)
    return out
