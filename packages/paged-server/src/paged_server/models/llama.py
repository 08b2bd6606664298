"""Llama (2, 3, 3.1, 3.2) in plain PyTorch, readable top to bottom.

Pre-norm decoder layers: RMSNorm -> attention -> residual, RMSNorm ->
SwiGLU MLP -> residual. RoPE follows the config (plain, linear or Llama 3
scaling). Qwen 3 is this model plus per-head q/k norms (see qwen3.py).
"""

from __future__ import annotations

import torch
from torch import nn

from paged_core.protocols import AttentionViewProtocol
from paged_server.models.base import CausalLM
from paged_server.models.config import ModelConfig
from paged_server.models.layers import Attention, GatedMLP, RMSNorm
from paged_server.models.rope import RotaryEmbedding
from paged_server.models.tensor_parallel import SINGLE, TensorParallel


class LlamaDecoderLayer(nn.Module):
    """One pre-norm transformer block."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, qk_norm: bool, tp: TensorParallel = SINGLE
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
            bias=c.attention_bias,
            qk_norm=(lambda: RMSNorm(c.head_dim, c.rms_norm_eps)) if qk_norm else None,
            sliding_window=c.layer_sliding_window(layer_idx),
            softcap=c.attn_logit_softcapping,
            tp=tp,
        )
        self.mlp = GatedMLP(
            c.hidden_size, c.intermediate_size, c.hidden_act, bias=c.mlp_bias, tp=tp
        )
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: AttentionViewProtocol | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm (weights under ``model.``)."""

    def __init__(
        self, config: ModelConfig, qk_norm: bool = False, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, qk_norm, tp) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        kv_cache: AttentionViewProtocol | None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, kv_cache)
        return self.norm(x)


class LlamaForCausalLM(CausalLM):
    """Llama with its LM head; weight names match Hugging Face checkpoints."""

    qk_norm = False

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, tp)
        self.model = LlamaModel(config, qk_norm=self.qk_norm, tp=tp)
        self._init_lm_head()
