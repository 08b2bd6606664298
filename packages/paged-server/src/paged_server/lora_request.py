"""``LoRARequest``: which LoRA adapter serves a request (vLLM's, same fields).

``LLM.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))``
serves those prompts with the adapter at ``lora_path`` (PEFT's format:
``adapter_config.json`` + ``adapter_model.safetensors``), loaded the first
time a request names it. The server makes one per ``--lora-modules`` entry
and per ``POST /v1/load_lora_adapter``; a request then names the adapter by
``lora_name`` as its ``model``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's ``LoRARequest``: ``lora_name`` (what requests and ``/v1/models``
    call it), ``lora_int_id`` (a positive id, unique per adapter, as vLLM
    asks), ``lora_path`` (its directory), ``base_model_name`` (the model it
    was trained on, shown as its ``parent``; None: the served model)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name: must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be an integer >= 1 (vLLM's rule), got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"lora_path: LoRA adapter {self.lora_name!r} needs the directory it is in")

    # vLLM's shorter names for the same fields
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
