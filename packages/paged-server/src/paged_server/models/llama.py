"""Llama (2, 3, 3.1, 3.2) in plain PyTorch, readable top to bottom.

Pre-norm decoder layers: RMSNorm -> attention -> residual, RMSNorm ->
SwiGLU MLP -> residual. RoPE follows the config (plain, linear, Llama 3
or longrope scaling). Mistral, Qwen 2, Qwen 3, Phi-3, Mixtral and Qwen 3
MoE are this model with a class attribute or the feed-forward changed
(their own files); biases and sliding windows come from the config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from paged_core.protocols import AttentionViewProtocol
from paged_server.models.base import CausalLM, DecoderStack, Rope
from paged_server.models.config import ModelConfig
from paged_server.models.layers import Attention, GatedMLP, RMSNorm
from paged_server.models.pipeline_parallel import WHOLE, PipelineStage
from paged_server.models.rope import RotaryEmbedding
from paged_server.models.tensor_parallel import SINGLE, TensorParallel

if TYPE_CHECKING:  # annotations only: a TP rank imports paged_ref inside its start-up guard
    from paged_ref.lora_ops import LoRAMapping


class LlamaDecoderLayer(nn.Module):
    """One pre-norm transformer block; ``family`` (the ``*ForCausalLM``
    class) says what varies: per-head q/k norms, stacked checkpoint
    projections, the feed-forward block."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        family: type[LlamaForCausalLM],
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        c = config
        self.self_attn = Attention(
            layer_idx=layer_idx,
            hidden_size=c.hidden_size,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            scale=c.head_dim**-0.5,
            bias=c.qkv_bias,
            o_bias=c.attention_bias,
            qk_norm=(lambda: RMSNorm(c.head_dim, c.rms_norm_eps)) if family.qk_norm else None,
            sliding_window=c.layer_sliding_window(layer_idx),
            softcap=c.attn_logit_softcapping,
            tp=tp,
            stored_as="qkv_proj" if family.stacked_checkpoint else None,
        )
        self.mlp = family.feed_forward(c, layer_idx, tp)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: AttentionViewProtocol | None,
        lora: LoRAMapping | None = None,
    ) -> torch.Tensor:
        h, x = self.post_attention_layernorm.add_norm(
            x, self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, lora)
        )
        return x + self.mlp(h, lora)


class LlamaModel(DecoderStack):
    """Embeddings, decoder layers and the final norm (weights under ``model.``);
    a pipeline stage's share of them (``pp``)."""

    def __init__(
        self,
        config: ModelConfig,
        family: type[LlamaForCausalLM],
        tp: TensorParallel,
        pp: PipelineStage,
    ) -> None:
        super().__init__(
            config,
            pp,
            lambda i: LlamaDecoderLayer(config, i, family, tp),
            lambda: RMSNorm(config.hidden_size, config.rms_norm_eps),
        )
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> list[Rope]:
        return [self.rotary(position_ids, dtype)] * len(self.layers[self.stage])


class LlamaForCausalLM(CausalLM):
    """Llama with its LM head; weight names match Hugging Face checkpoints.
    Families of the same layout subclass it and change the class attributes."""

    qk_norm = False  # RMSNorm on each head's q and k (Qwen 3)
    stacked_checkpoint = False  # the checkpoint stores qkv_proj / gate_up_proj (Phi-3)

    def __init__(
        self, config: ModelConfig, tp: TensorParallel = SINGLE, pp: PipelineStage = WHOLE
    ) -> None:
        super().__init__(config, tp, pp)
        self.model = LlamaModel(config, type(self), tp, self.pp)
        self._init_lm_head()

    @classmethod
    def feed_forward(cls, c: ModelConfig, layer_idx: int, tp: TensorParallel) -> nn.Module:
        """Layer ``layer_idx``'s MLP (mixture-of-experts families override it)."""
        stored_as = "gate_up_proj" if cls.stacked_checkpoint else None
        return GatedMLP(
            c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias, tp, stored_as=stored_as
        )
