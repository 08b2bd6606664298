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

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from paged_core.protocols import AttentionViewProtocol
from paged_server.models.config import ModelConfig
from paged_server.models.few_row_gemm import few_rows
from paged_server.models.pipeline_parallel import WHOLE, PipelineStage, for_stage
from paged_server.models.tensor_parallel import SINGLE, TensorParallel

if TYPE_CHECKING:  # annotations only: a TP rank imports paged_ref inside its start-up guard
    from paged_ref.lora_ops import LoRAMapping

Rope = tuple[torch.Tensor, torch.Tensor]  # one layer's (cos, sin)


class DecoderStack(nn.Module):
    """What every family's ``self.model`` shares: the embeddings (on the
    first pipeline stage, and the last when tied), this stage's decoder
    layers and the final norm (on the last stage). A family says how its
    layers' RoPE is (``rope``) and may scale the embeddings."""

    def __init__(
        self,
        config: ModelConfig,
        pp: PipelineStage,
        layer: Callable[[int], nn.Module],
        norm: Callable[[], nn.Module],
    ) -> None:
        super().__init__()
        self.embed_tokens = (
            nn.Embedding(config.vocab_size, config.hidden_size)
            if pp.holds_embedding(config.tie_word_embeddings)
            else None
        )
        self.layers = pp.layer_modules(layer)
        self.stage = slice(pp.layers.start, pp.layers.stop)
        self.norm = norm() if pp.is_last else None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        kv_cache: AttentionViewProtocol | None,
        intermediate: torch.Tensor | None = None,
        lora: LoRAMapping | None = None,
    ) -> torch.Tensor:
        """This stage's layers over the embeddings of ``input_ids`` (the first
        stage) or the previous stage's ``intermediate``; normed on the last."""
        if intermediate is None:
            assert self.embed_tokens is not None, "a later pipeline stage needs the activations"
            x = self.scale_embeddings(self.embed_tokens(input_ids))
        else:
            x = intermediate
        layers = self.layers[self.stage]
        for layer, (cos, sin) in zip(layers, self.rope(position_ids, x.dtype), strict=True):
            x = layer(x, cos, sin, kv_cache, lora)
        return self.norm(x) if self.norm is not None else x

    def scale_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        """The embeddings as the first layer takes them (unscaled but in Gemma)."""
        return x

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> list[Rope]:
        """Each of this stage's layers' RoPE ``(cos, sin)`` at ``position_ids``."""
        raise NotImplementedError


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
        head = few_rows(self.lm_head, hidden)  # the kernel's product at 1-8 bf16 rows (CPU)
        logits = (self.lm_head(hidden) if head is None else head).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits
