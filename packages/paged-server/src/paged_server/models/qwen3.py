"""Qwen 3 (dense): the Llama block plus RMSNorm on each head's q and k
before RoPE, which keeps attention logits bounded without soft-capping."""

from __future__ import annotations

from paged_server.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Weight names: ``self_attn.q_norm`` / ``self_attn.k_norm`` per layer."""

    qk_norm = True
