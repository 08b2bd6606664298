"""The attention layouts of published checkpoints, one or more per
supported architecture, read off their config.json files: heads, KV heads,
head_dim, and what each kind of layer passes to the kernels (window,
soft-cap). The compile matrix derives its variants from these through the
start-up warm-up list (``warmup.kernel_variants``), per tensor-parallel
split, so a family registered in ``paged_server.models.registry`` is
compiled for every GPU the day its layouts are listed here (a test checks
that every registered architecture has one).
"""

from __future__ import annotations

from dataclasses import dataclass

from paged_triton.warmup import LayerAttention

FULL = LayerAttention()


@dataclass(frozen=True, slots=True)
class PublishedLayout:
    """One published checkpoint's attention: ``layers`` are its distinct
    kinds of layer; ``max_model_len`` its context (decides whether decode
    may split, so whether the merge kernel is compiled)."""

    architecture: str
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    layers: tuple[LayerAttention, ...] = (FULL,)
    max_model_len: int = 32768

    def tp_sizes(self, limit: int = 8) -> list[int]:
        """The tensor-parallel sizes this layout splits into (powers of two
        up to ``limit`` dividing the heads; KV heads split or replicate)."""
        sizes = []
        tp = 1
        while tp <= limit:
            kv_ok = self.kv_heads % tp == 0 or tp % self.kv_heads == 0
            if self.heads % tp == 0 and kv_ok:
                sizes.append(tp)
            tp *= 2
        return sizes

    def per_rank(self, tp: int) -> tuple[int, int]:
        """(query heads, KV heads) one rank holds at ``tp``."""
        return self.heads // tp, max(1, self.kv_heads // tp)


def _window(size: int, softcap: float | None = None) -> LayerAttention:
    return LayerAttention(size, softcap)


@dataclass(frozen=True, slots=True)
class PublishedExperts:
    """One published mixture of experts: ``experts`` gated MLPs of
    ``intermediate`` features over ``hidden``, ``top_k`` per token."""

    name: str
    experts: int
    hidden: int
    intermediate: int
    top_k: int


MOE: tuple[PublishedExperts, ...] = (
    PublishedExperts("Mixtral 8x7B", 8, 4096, 14336, 2),
    PublishedExperts("Qwen3 30B-A3B", 128, 2048, 768, 8),
)

PUBLISHED: tuple[PublishedLayout, ...] = (
    PublishedLayout("LlamaForCausalLM", "Llama 3.2 1B", 32, 8, 64),
    PublishedLayout("LlamaForCausalLM", "Llama 3.2 3B", 24, 8, 128),
    PublishedLayout("LlamaForCausalLM", "Llama 3.1 8B", 32, 8, 128),
    PublishedLayout("MistralForCausalLM", "Mistral 7B v0.1", 32, 8, 128, (_window(4096),)),
    PublishedLayout("MixtralForCausalLM", "Mixtral 8x7B", 32, 8, 128),
    PublishedLayout("Qwen2ForCausalLM", "Qwen2.5 0.5B", 14, 2, 64),
    PublishedLayout("Qwen2ForCausalLM", "Qwen2.5 7B", 28, 4, 128),
    PublishedLayout("Qwen3ForCausalLM", "Qwen3 0.6B", 16, 8, 128),
    PublishedLayout("Qwen3ForCausalLM", "Qwen3 8B", 32, 8, 128),
    PublishedLayout("Qwen3MoeForCausalLM", "Qwen3 30B-A3B", 32, 4, 128),
    PublishedLayout("Phi3ForCausalLM", "Phi-3 mini 4k", 32, 32, 96, (_window(2047),), 4096),
    PublishedLayout("Phi3ForCausalLM", "Phi-3 medium 4k", 40, 10, 128, (_window(2047),), 4096),
    PublishedLayout(
        "Gemma2ForCausalLM", "Gemma 2 2B", 8, 4, 256, (_window(4096, 50.0), LayerAttention(None, 50.0)), 8192
    ),
    PublishedLayout(
        "Gemma2ForCausalLM", "Gemma 2 27B", 32, 16, 128, (_window(4096, 50.0), LayerAttention(None, 50.0)), 8192
    ),
    PublishedLayout("Gemma3ForCausalLM", "Gemma 3 1B", 4, 1, 256, (_window(512), FULL)),
    PublishedLayout("Gemma3ForConditionalGeneration", "Gemma 3 4B", 8, 4, 256, (_window(1024), FULL)),
    PublishedLayout("Gemma3ForConditionalGeneration", "Gemma 3 12B", 16, 8, 256, (_window(1024), FULL)),
)
