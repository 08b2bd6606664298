"""Phi-3 (mini, small context and 128k): the Llama block, saved with q/k/v
already stacked as ``qkv_proj`` and gate/up as ``gate_up_proj``. Each rank
reads its heads' rows of the stacked tensors (``linear.stored_stacked``).
head_dim is 96 in the published checkpoints (the Triton kernels pad the
head tile to 128); the 128k models ask for longrope (``rope.py``)."""

from __future__ import annotations

from paged_server.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Weight names: ``self_attn.qkv_proj``, ``mlp.gate_up_proj``."""

    stacked_checkpoint = True
