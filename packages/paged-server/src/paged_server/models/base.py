"""What every model family shares: the forward contract, the LM head, tying.

With a cache view the model runs one flat batch: ``input_ids`` and
``position_ids`` are ``[num_tokens]`` (every scheduled token of every
sequence, no padding) and the view knows which tokens belong to whom.
Without one, ``[batch, length]`` sequences run with plain causal attention
(tests, scoring). The runner calls ``hidden_states`` then ``compute_logits``
on the rows it samples from, so a long prefill never builds ``[L, vocab]``
logits. Committing the pass (``kv_cache.advance``) is the caller's job, once
the pass has succeeded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from paged_core.protocols import AttentionViewProtocol
from paged_server.models.config import ModelConfig
from paged_server.models.pipeline_parallel import WHOLE, PipelineStage, for_stage
from paged_server.models.tensor_parallel import SINGLE, TensorParallel

if TYPE_CHECKING:  # annotations only: a TP rank imports paged_ref inside its start-up guard
    from paged_ref.lora_ops import LoRAMapping


class CausalLM(nn.Module):
    """Base for ``*ForCausalLM`` models: ``self.model`` (embeddings, layers,
    final norm; Hugging Face weight names) and ``self.lm_head``. A pipeline
    stage (``pp``) holds only its part: the embeddings on the first stage,
    its layers, the final norm and ``lm_head`` on the last."""

    model: nn.Module
    # False where the forward pass syncs with the host or has data-dependent
    # shapes (the experts' grouped path): the engine then runs it eagerly,
    # neither replayed from CUDA graphs nor compiled (torch.compile).
    graph_safe = True

    def __init__(
        self, config: ModelConfig, tp: TensorParallel = SINGLE, pp: PipelineStage = WHOLE
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp  # this rank's shard (the LM head stays whole on every rank)
        self.pp = for_stage(pp, config.num_layers)  # this rank's layers

    def _init_lm_head(self) -> None:
        """Create ``lm_head`` (on the last stage) after ``self.model`` so that
        tied checkpoints name the shared weight ``model.embed_tokens.weight``."""
        if self.pp.is_last:
            self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
            self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head where the config says
        so (call again after moving a meta-built model to a real device)."""
        if self.config.tie_word_embeddings and self.pp.is_last:
            embed = self.model.get_submodule("embed_tokens")
            assert isinstance(embed, nn.Embedding)
            self.lm_head.weight = embed.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        kv_cache: AttentionViewProtocol | None = None,
        lora: LoRAMapping | None = None,
    ) -> torch.Tensor:
        """Float32 logits ``[..., vocab]`` for ``input_ids`` at ``position_ids``
        (same shape: ``[num_tokens]`` with a view, ``[batch, length]`` without).
        With a cache view, attention covers cached + new tokens; the view is
        not advanced. ``lora``: each row's adapter (``models.lora``)."""
        return self.compute_logits(
            self.hidden_states(input_ids, position_ids, kv_cache, lora=lora)
        )

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        kv_cache: AttentionViewProtocol | None = None,
        intermediate: torch.Tensor | None = None,
        lora: LoRAMapping | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states ``[..., hidden]``; on a pipeline stage,
        its layers' output (normed on the last stage) from the previous
        stage's ``intermediate`` (the embeddings on the first). ``lora``:
        the step's rows' adapter slots (``LoRAMapping``, one row per token,
        in ``input_ids``' order flattened); None runs the base model."""
        if input_ids.shape != position_ids.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and position_ids "
                f"{tuple(position_ids.shape)} must have the same shape"
            )
        if kv_cache is not None and input_ids.dim() != 1:
            raise ValueError(
                f"with a cache view the batch is flat [num_tokens]; got input_ids of shape "
                f"{tuple(input_ids.shape)}"
            )
        return self.model(input_ids, position_ids, kv_cache, intermediate, lora)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head in the model dtype, then float32 (and final soft-capping)."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits
