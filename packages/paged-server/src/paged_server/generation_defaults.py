"""The model's recommended sampling settings (``generation_config.json``),
applied to requests that leave a field unset, as vLLM's
``--generation-config auto`` (its default) does.

``auto`` reads the model directory's file, a directory path reads that one's,
``vllm`` reads none (temperature 1.0 and friends, the API's own defaults);
``override_generation_config`` goes on top. Only sampling fields are taken:
temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as
the default ``max_tokens`` of a request that sets none (vLLM also caps
explicit ``max_tokens`` by it; here an explicit value is honoured).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field
GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# What a request that sets none of them gets without any generation config.
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def generation_defaults(
    model_dir: str | None, source: str, override: dict[str, Any] | None = None
) -> dict[str, Any]:
    """SamplingParams field -> default, from ``source`` (``auto``, ``vllm`` or
    a directory) and ``override`` (keys as in generation_config.json or as
    SamplingParams names them). Raises ``ValueError`` for an unknown key or
    a directory without the file."""
    values: dict[str, Any] = {}
    if source != "vllm":
        directory = model_dir if source == "auto" else source
        file = Path(directory) / "generation_config.json" if directory else None
        if file is not None and file.is_file():
            values = _sampling_fields(json.loads(file.read_text(encoding="utf-8")))
        elif source != "auto":
            raise ValueError(
                f"generation_config: {source} holds no generation_config.json; pass a model "
                "directory, 'auto' (the model's) or 'vllm' (none)"
            )
    if values:
        log.info(
            "sampling defaults from the model's generation_config.json: %s (requests that set "
            "a field override it; --generation-config vllm ignores the file)", values,
        )
    for key, value in (override or {}).items():
        name = GENERATION_KEYS.get(key, key)
        if name not in GENERATION_KEYS.values():
            raise ValueError(
                f"override_generation_config: unknown key {key!r}; known: "
                f"{', '.join(GENERATION_KEYS)}"
            )
        values[name] = value
    return values


def _sampling_fields(config: dict[str, Any]) -> dict[str, Any]:
    return {
        name: config[key]
        for key, name in GENERATION_KEYS.items()
        if config.get(key) is not None
    }
