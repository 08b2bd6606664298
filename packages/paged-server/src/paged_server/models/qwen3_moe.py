"""Qwen 3 MoE (30B-A3B, 235B-A22B): Qwen 3's attention (per-head q/k
norms) with Mixtral's kind of sparse experts (``moe.py``), no shared
expert. ``norm_topk_prob`` renormalizes the chosen experts' weights; layers
in ``mlp_only_layers`` (or off the ``decoder_sparse_step``) stay dense."""

from __future__ import annotations

from paged_server.models.mixtral import MixtralForCausalLM


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    """Weight names: ``mlp.gate``, ``mlp.experts.{e}.gate_proj/up_proj/down_proj``."""

    qk_norm = True
    expert_names = ("gate_proj", "up_proj", "down_proj")
