"""Gemma 3 (text) in plain PyTorch.

What differs from Llama: embeddings scaled by sqrt(hidden_size); RMSNorm
weights stored as offsets from one; four norms per block (before and after
both attention and MLP); per-head q/k norms; GeGLU; attention scaled by
``query_pre_attn_scalar``; sliding-window layers interleaved with global
ones, each kind with its own RoPE base; optional tanh soft-capping of
attention scores and final logits.

Soft-capping of attention scores is applied whenever config.json sets
``attn_logit_softcapping`` (released Gemma 3 checkpoints leave it null;
transformers 5 ignores the field for Gemma 3).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from paged_core.protocols import AttentionViewProtocol
from paged_server.models.base import CausalLM, DecoderStack, Rope
from paged_server.models.config import SLIDING_ATTENTION, ModelConfig
from paged_server.models.layers import Attention, GatedMLP, RMSNorm
from paged_server.models.pipeline_parallel import WHOLE, PipelineStage
from paged_server.models.rope import RotaryEmbedding
from paged_server.models.tensor_parallel import SINGLE, TensorParallel

if TYPE_CHECKING:  # annotations only: a TP rank imports paged_ref inside its start-up guard
    from paged_ref.lora_ops import LoRAMapping


class Gemma3DecoderLayer(nn.Module):
    """Sandwich-norm block: norm -> attention -> norm -> residual, same for the MLP."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, qk_norm: bool, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        c = config
        self.is_sliding = c.layer_types[layer_idx] == SLIDING_ATTENTION
        scalar = c.query_pre_attn_scalar or c.head_dim
        self.self_attn = Attention(
            layer_idx=layer_idx,
            hidden_size=c.hidden_size,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            scale=scalar**-0.5,
            bias=c.attention_bias,
            qk_norm=(lambda: RMSNorm(c.head_dim, c.rms_norm_eps, unit_offset=True))
            if qk_norm
            else None,
            sliding_window=c.layer_sliding_window(layer_idx),
            softcap=c.attn_logit_softcapping,
            tp=tp,
        )
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, tp=tp)
        self.input_layernorm = self._norm(c)
        self.post_attention_layernorm = self._norm(c)
        self.pre_feedforward_layernorm = self._norm(c)
        self.post_feedforward_layernorm = self._norm(c)

    @staticmethod
    def _norm(c: ModelConfig) -> RMSNorm:
        return RMSNorm(c.hidden_size, c.rms_norm_eps, unit_offset=True)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: AttentionViewProtocol | None,
        lora: LoRAMapping | None = None,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, lora)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x), lora)
        return x + self.post_feedforward_layernorm(mlp)


class Gemma3Model(DecoderStack):
    """Scaled embeddings, layers with local or global RoPE, final norm."""

    def __init__(
        self, config: ModelConfig, qk_norm: bool, tp: TensorParallel, pp: PipelineStage
    ) -> None:
        super().__init__(
            config,
            pp,
            lambda i: Gemma3DecoderLayer(config, i, qk_norm, tp),
            lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True),
        )
        self.embed_scale = config.hidden_size**0.5
        self._scales: dict[torch.dtype, float] = {}
        max_pos = config.max_position_embeddings
        self.global_rotary = RotaryEmbedding(config.rope, config.head_dim, max_pos)
        self.local_rotary = (  # Gemma 2 has one RoPE for both kinds of layer
            RotaryEmbedding(config.local_rope, config.head_dim, max_pos)
            if config.local_rope
            else self.global_rotary
        )

    def _rounded_scale(self, dtype: torch.dtype) -> float:
        """The embedding scale rounded to the weights' dtype first, as the
        checkpoints expect; a Python float, so no tensor is made per step
        (that would be a host-to-device copy inside a CUDA graph)."""
        scale = self._scales.get(dtype)
        if scale is None:
            scale = self._scales[dtype] = float(torch.tensor(self.embed_scale, dtype=dtype))
        return scale

    def scale_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        return x * self._rounded_scale(x.dtype)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> list[Rope]:
        """The local RoPE for sliding-window layers, the global one for the others."""
        global_ = self.global_rotary(position_ids, dtype)
        local = global_
        if self.local_rotary is not self.global_rotary:
            local = self.local_rotary(position_ids, dtype)
        return [local if layer.is_sliding else global_ for layer in self.layers[self.stage]]


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text model; the LM head is tied to the embeddings by default."""

    qk_norm = True  # Gemma 2 has none (gemma2.py)

    def __init__(
        self, config: ModelConfig, tp: TensorParallel = SINGLE, pp: PipelineStage = WHOLE
    ) -> None:
        super().__init__(config, tp, pp)
        self.model = Gemma3Model(config, self.qk_norm, tp, self.pp)
        self._init_lm_head()
