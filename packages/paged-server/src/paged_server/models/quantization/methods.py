"""Which quantization a model loads with: the checkpoint's, or ``--quantization``.

As vLLM: a checkpoint whose config.json has a ``quantization_config`` is
loaded in that format with no flag (a flag that names another method is an
error); ``--quantization`` on a 16/32-bit checkpoint quantizes its linear
layers at load (online). vLLM's names where vLLM has the method:
``compressed-tensors``, ``gptq`` (``gptq_marlin``), ``awq`` (``awq_marlin``),
``fp8`` (online: fp8 e4m3 weights, one scale per tensor). vLLM has no
online weight-only integer method of its own (it reaches torchao or
bitsandbytes for that); ours are ``int8`` (per output channel, symmetric)
and ``int4`` (groups of 128 input features, symmetric).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paged_server.models.errors import InvalidConfigError
from paged_server.models.quantization import awq, compressed_tensors, gptq

CHECKPOINT_METHODS = ("compressed-tensors", "gptq", "awq")
ONLINE_METHODS = ("fp8", "int8", "int4")
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
GGUF = "gguf"  # vLLM's name for a .gguf file's own formats (models/gguf_tensors.py)
QUANTIZATION_METHODS = (*CHECKPOINT_METHODS, *ONLINE_METHODS, GGUF, *ALIASES)
READERS = {"compressed-tensors": compressed_tensors, "gptq": gptq, "awq": awq}


@dataclass(frozen=True, slots=True)
class Quantization:
    """``name`` (one of ``CHECKPOINT_METHODS`` or ``ONLINE_METHODS``), the
    checkpoint's ``quantization_config`` (empty when online) and a short
    description for the start-up line."""

    name: str
    description: str
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def online(self) -> bool:
        return self.name in ONLINE_METHODS


def resolve_quantization(hf: dict[str, Any], flag: str | None) -> Quantization | None:
    """The method to load with, from config.json and ``--quantization``."""
    wanted = ALIASES.get(flag, flag) if flag else None
    if wanted is not None and wanted not in (*CHECKPOINT_METHODS, *ONLINE_METHODS, GGUF):
        raise InvalidConfigError(
            f"quantization {flag!r} is not supported; use one of {', '.join(QUANTIZATION_METHODS)}"
        )
    if wanted == GGUF:
        raise InvalidConfigError(
            "quantization='gguf' loads a GGUF file, but the model is a Hugging Face directory; "
            "pass --model FILE.gguf, or drop the flag"
        )
    qc = hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config")
    if qc and not isinstance(qc, dict):
        raise InvalidConfigError(
            f"config.json's quantization_config must be an object with a quant_method, got "
            f"{type(qc).__name__} {qc!r:.60}"
        )
    if qc:
        method = str(qc.get("quant_method", "")).lower()
        if method not in CHECKPOINT_METHODS:
            raise InvalidConfigError(
                f"the checkpoint's quantization_config has quant_method {method!r}, which is not "
                f"supported; supported: {', '.join(CHECKPOINT_METHODS)}"
            )
        if wanted is not None and wanted != method:
            raise InvalidConfigError(
                f"the checkpoint is quantized with {method} but quantization={flag!r} was "
                f"given; drop the flag (the format is detected) or pass {method}"
            )
        return Quantization(method, READERS[method].check_config(qc), qc)
    if wanted is None:
        return None
    if wanted in CHECKPOINT_METHODS:
        raise InvalidConfigError(
            f"quantization={flag!r} needs a {wanted} checkpoint, but config.json has no "
            f"quantization_config; for 16/32-bit weights use one of {', '.join(ONLINE_METHODS)}"
        )
    description = {
        "fp8": "fp8_e4m3 per-tensor (online)",
        "int8": "int8 per-channel (online)",
        "int4": "int4 g128 (online)",
    }[wanted]
    return Quantization(wanted, description)
