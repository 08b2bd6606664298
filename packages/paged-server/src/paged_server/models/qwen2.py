"""Qwen 2 and Qwen 2.5 (dense): the Llama block with a bias on q, k and v
(not on the output projection). The fused q/k/v GEMM carries the three
biases stacked as the weights are (``ModelConfig.qkv_bias``, on by the
registry's default for this family)."""

from __future__ import annotations

from paged_server.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Weight names as Llama's, plus ``q_proj.bias``/``k_proj.bias``/``v_proj.bias``."""
