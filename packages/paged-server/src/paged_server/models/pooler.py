"""Pooling models (vLLM's ``--runner pooling``): which head a checkpoint
runs with, how its token states become one vector, and the head itself.

A decoder LM becomes a pooling model by swapping its LM head: an embedding
model's head is the identity (the final-norm hidden states), a classifier's
(``*ForSequenceClassification``) is the checkpoint's ``score`` projection.
How the states are pooled comes from the checkpoint as sentence-transformers
saves it (``modules.json``: a ``Pooling`` module's ``config.json`` says mean,
CLS or last token; a ``Normalize`` module L2-normalizes), else vLLM's default
for a converted decoder: the last token, normalized (Qwen3-Embedding's way).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paged_server.models.errors import InvalidConfigError

if TYPE_CHECKING:
    from paged_server.models.base import CausalLM

log = logging.getLogger(__name__)

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
# vLLM's deprecated --task values, as (runner, convert) ("score": the checkpoint's head)
TASKS = {
    "auto": ("auto", "auto"),
    "generate": ("generate", "auto"),
    "embed": ("pooling", "embed"),
    "embedding": ("pooling", "embed"),
    "classify": ("pooling", "classify"),
    "score": ("pooling", "auto"),
}
# config.json architectures of checkpoints saved with a pooling head, by name ending
POOLING_SUFFIXES = {"Model": "embed", "ForSequenceClassification": "classify"}
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}  # fmt: skip
_POOLER_KEYS = ("pooling_type", "normalize", "activation", "softmax")


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """How a pooling model's states become its answer. ``head``: ``embed``
    or ``classify``; ``pooling_type``: LAST, MEAN or CLS; ``normalize``:
    L2-normalize embeddings; ``num_labels``: a classifier's classes;
    ``matryoshka``: ``dimensions`` is allowed (``None``: no; ``()``: any
    size; else the sizes config.json lists)."""

    head: str
    pooling_type: str = "LAST"
    normalize: bool = True
    activation: bool = True
    num_labels: int = 0
    matryoshka: tuple[int, ...] | None = None
    labels: tuple[str, ...] = ()  # a classifier's class names (config.json's id2label)

    @property
    def skips_prefix_cache(self) -> bool:
        """Mean and CLS pooling need every prompt token's (or the first's)
        states computed, so a prefix-cache hit cannot serve them."""
        return self.pooling_type != "LAST"


def checkpoint_head(architecture: str) -> str | None:
    """The pooling head an ``architectures`` name carries (``embed`` for
    ``*Model``, ``classify`` for ``*ForSequenceClassification``), else None."""
    for suffix, head in POOLING_SUFFIXES.items():
        if architecture.endswith(suffix):
            return head
    return None


def resolve_head(architecture: str, runner: str, convert: str, task: str | None) -> str | None:
    """vLLM's ``--runner`` / ``--convert`` (and the older ``--task``) for
    this architecture: the pooling head to run (``embed``/``classify``), or
    None to generate. Raises ``ValueError`` for a combination that cannot run."""
    if task is not None and task != "auto":
        if task not in TASKS:
            raise ValueError(f"task: must be one of {', '.join(TASKS)}, got {task!r}")
        runner, convert = TASKS[task]
    if runner not in RUNNERS:
        raise ValueError(f"runner: must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert: must be one of {', '.join(CONVERTS)}, got {convert!r}")
    own = checkpoint_head(architecture)
    if runner == "auto":
        runner = "pooling" if own is not None or convert in ("embed", "classify") else "generate"
    if runner == "generate":
        if own is not None:
            raise ValueError(
                f"runner: {architecture} is a pooling model (no LM head); serve it with "
                "--runner pooling (or drop --runner)"
            )
        return None
    if convert in ("embed", "classify"):
        return convert
    if own is None and convert == "none":
        raise ValueError(
            f"convert: {architecture} has no pooling head; use --convert embed (or classify)"
        )
    return own or "embed"


def read_pooler_config(
    path: Path | None, hf: dict[str, Any], head: str, override: dict[str, Any] | None = None
) -> PoolerConfig:
    """The pooling a checkpoint declares (sentence-transformers' files in
    ``path``, config.json's Matryoshka sizes and labels), with ``override``
    (vLLM's ``--pooler-config``) on top."""
    pooling_type, normalize = "LAST", head == "embed"
    modules = _sentence_transformers_modules(path)
    if modules is not None:
        pooling_type, normalize = _st_pooling(path, modules), any(
            m.get("type", "").endswith("Normalize") for m in modules
        )
    activation = True
    for key, value in (override or {}).items():
        if key not in _POOLER_KEYS:
            raise ValueError(f"pooler_config: {key!r} is not supported; supported: {', '.join(_POOLER_KEYS)}")
        if key == "pooling_type":
            pooling_type = str(value).upper()
        elif key == "normalize":
            normalize = bool(value)
        else:
            activation = bool(value)
    if pooling_type not in POOLING_TYPES:
        raise ValueError(
            f"pooling_type: {pooling_type} is not supported; use one of {', '.join(POOLING_TYPES)}"
        )
    labels = hf.get("id2label")
    names = tuple(str(labels[k]) for k in sorted(labels, key=int)) if isinstance(labels, dict) else ()
    num_labels = len(names) or int(hf.get("num_labels", 2))
    return PoolerConfig(
        head, pooling_type, normalize and head == "embed", activation,
        num_labels if head == "classify" else 0, _matryoshka(hf), names if head == "classify" else (),
    )  # fmt: skip


def _sentence_transformers_modules(path: Path | None) -> list[dict[str, Any]] | None:
    file = None if path is None else path / "modules.json"
    if file is None or not file.is_file():
        return None
    try:
        modules = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidConfigError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(modules, list):
        raise InvalidConfigError(f"{file} must hold a list of modules")
    return [m for m in modules if isinstance(m, dict)]


def _st_pooling(path: Path | None, modules: list[dict[str, Any]]) -> str:
    """The pooling mode of the ``Pooling`` module's config.json (LAST when
    the checkpoint lists none)."""
    assert path is not None
    pooling = [m for m in modules if m.get("type", "").endswith("Pooling")]
    if not pooling:
        return "LAST"
    file = path / str(pooling[0].get("path", "1_Pooling")) / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidConfigError(f"{file}: the pooling config modules.json names is unreadable: {exc}") from None
    chosen = [mode for key, mode in _ST_MODES.items() if config.get(key)]
    others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
    if others or len(chosen) != 1:
        raise InvalidConfigError(
            f"{file}: pooling {', '.join(others) or 'of ' + str(len(chosen)) + ' modes'} is not "
            "supported; one of pooling_mode_mean_tokens, pooling_mode_cls_token, "
            "pooling_mode_lasttoken must be set"
        )
    return chosen[0]


def _matryoshka(hf: dict[str, Any]) -> tuple[int, ...] | None:
    """config.json's ``matryoshka_dimensions`` (those sizes), or
    ``is_matryoshka`` (any size), as vLLM reads them."""
    sizes = hf.get("matryoshka_dimensions")
    if isinstance(sizes, list) and sizes:
        return tuple(int(s) for s in sizes)
    return () if hf.get("is_matryoshka") else None


def attach_head(model: CausalLM, pooler: PoolerConfig, dtype: torch.dtype, device: torch.device) -> None:
    """Swap ``model.lm_head`` for the pooling head (on the last pipeline
    stage, which holds it): the identity for embeddings, a ``num_labels``
    projection for a classifier (filled from the checkpoint's ``score``).
    The head's rows are then what the engine's "logits" hold."""
    if not model.pp.is_last:
        return
    config = model.config
    config.tie_word_embeddings = False  # the head no longer shares the embeddings
    config.final_logit_softcapping = None  # transformers' classifiers do not cap
    if pooler.head == "embed":
        model.lm_head = nn.Identity()  # type: ignore[assignment]  # the head is any module
    else:
        model.lm_head = nn.Linear(
            config.hidden_size, pooler.num_labels, bias=False, device=device, dtype=dtype
        )


def pooling_weight_name(name: str | None, head: str) -> str | None:
    """A checkpoint tensor's name for a pooling model: sentence-transformers'
    and AutoModel's saves drop the ``model.`` prefix; a classifier's
    ``score`` is its head; an embedding model skips any LM head."""
    if name is None:
        return None
    if name.startswith(("embed_tokens.", "layers.", "norm.")):
        return "model." + name
    if name.startswith("lm_head."):
        return None
    if name.startswith("score.") and head == "classify":
        return "lm_head." + name.removeprefix("score.")
    return name
