"""Mixtral: the Llama (Mistral) block with a sparse mixture of experts in
place of the MLP (``moe.py``). Checkpoints name it ``block_sparse_moe``
with experts ``w1`` (gate), ``w3`` (up), ``w2`` (down); the registry maps
``block_sparse_moe`` onto ``mlp``."""

from __future__ import annotations

from torch import nn

from paged_server.models.config import ModelConfig
from paged_server.models.llama import LlamaForCausalLM
from paged_server.models.moe import SparseMoeBlock
from paged_server.models.tensor_parallel import TensorParallel


class MixtralForCausalLM(LlamaForCausalLM):
    """Every layer routes each token to ``num_experts_per_tok`` experts."""

    graph_safe = False
    expert_names = ("w1", "w3", "w2")  # gate, up, down

    @classmethod
    def feed_forward(cls, c: ModelConfig, layer_idx: int, tp: TensorParallel) -> nn.Module:
        if not c.layer_is_moe(layer_idx):
            return super().feed_forward(c, layer_idx, tp)
        return SparseMoeBlock(
            c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
            c.hidden_act, c.norm_topk_prob, cls.expert_names, tp,
        )  # fmt: skip
