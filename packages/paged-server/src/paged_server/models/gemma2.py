"""Gemma 2: Gemma 3's block without the per-head q/k norms, which it
replaces by tanh soft-capping of the attention scores (50) and of the final
logits (30), both from config.json. Sliding and global layers alternate
(layer 0 slides) and share one RoPE base. The paged kernels apply the
soft-cap; the hybrid KV manager keeps only the window for sliding layers."""

from __future__ import annotations

from paged_server.models.gemma3 import Gemma3ForCausalLM


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Weight names as Gemma 3's, less ``q_norm``/``k_norm``; four norms per layer."""

    qk_norm = False
