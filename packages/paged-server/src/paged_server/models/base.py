"""What every model family shares: the forward contract, the LM head, tying.

The engine and tests call ``model(input_ids, position_ids, kv_cache)``; the
runner may call ``hidden_states`` then ``compute_logits`` on the rows it
samples from, so that a long prefill never builds ``[L, vocab]`` logits.
"""

from __future__ import annotations

import torch
from torch import nn

from paged_core.protocols import AttentionViewProtocol
from paged_server.models.config import ModelConfig


class CausalLM(nn.Module):
    """Base for ``*ForCausalLM`` models: ``self.model`` (embeddings, layers,
    final norm; Hugging Face weight names) and ``self.lm_head``."""

    model: nn.Module

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    def _init_lm_head(self) -> None:
        """Create ``lm_head`` after ``self.model`` so that tied checkpoints
        name the shared weight ``model.embed_tokens.weight``."""
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head where the config says
        so (call again after moving a meta-built model to a real device)."""
        if self.config.tie_word_embeddings:
            embed = self.model.get_submodule("embed_tokens")
            assert isinstance(embed, nn.Embedding)
            self.lm_head.weight = embed.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        kv_cache: AttentionViewProtocol | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, L, vocab]`` in float32 for ``input_ids [B, L]`` at
        ``position_ids [B, L]`` (each sequence's own positions). With a cache
        view, attention covers cached + new tokens and the view is advanced."""
        return self.compute_logits(self.hidden_states(input_ids, position_ids, kv_cache))

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        kv_cache: AttentionViewProtocol | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states ``[B, L, hidden]``; advances ``kv_cache`` by ``L``."""
        if input_ids.shape != position_ids.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and position_ids "
                f"{tuple(position_ids.shape)} must have the same [batch, length] shape"
            )
        hidden = self.model(input_ids, position_ids, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(input_ids.shape[1])
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head in the model dtype, then float32 (and final soft-capping)."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits
