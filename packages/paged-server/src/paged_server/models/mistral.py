"""Mistral: the Llama layout. Its config.json ``sliding_window`` (Mistral
7B v0.1: 4096; later versions null) applies to every layer, so the pool
frees blocks that leave the window (``ModelConfig`` reads it)."""

from __future__ import annotations

from paged_server.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Weight names as Llama's."""
