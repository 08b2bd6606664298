"""Tiny checkpoints of five families for the tensor-parallel tests.

Saved by transformers as real safetensors directories with a real tokenizer.
Llama and Qwen 3 have 4 query and 2 KV heads (TP=2 splits both); Gemma 3
has a single KV head, as Gemma 3 1B does, so TP=2 replicates it. Phi-3's
checkpoint stores q/k/v and gate/up stacked (each rank cuts its rows out of
them); Mixtral's experts are each split along their features. Wide
random weights make greedy outputs depend on the whole context.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from paged_server.default_model.tokenizer_builder import build_tokenizer

VOCAB = 512
FAMILIES = ("llama", "qwen3", "gemma3", "phi3", "mixtral")

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    initializer_range=0.3,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def _model(family: str) -> Any:
    if family == "llama":
        return LlamaForCausalLM(
            LlamaConfig(num_key_value_heads=2, head_dim=16, attention_bias=True, **_COMMON)
        )
    if family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(num_key_value_heads=2, head_dim=16, **_COMMON))
    if family == "phi3":
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(num_key_value_heads=2, **_COMMON))
    if family == "mixtral":
        config = transformers.MixtralConfig(
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **_COMMON
        )
        return transformers.MixtralForCausalLM(config)
    config = Gemma3TextConfig(
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
        **_COMMON,
    )
    return Gemma3ForCausalLM(config)


@pytest.fixture(scope="session")
def tp_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``family -> model directory`` (Llama with attention biases, so the
    row-parallel bias path runs too)."""
    tokenizer = build_tokenizer(VOCAB)
    out = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(f"tp-{family}")
        _model(family).save_pretrained(path)
        tokenizer.save(str(path / "tokenizer.json"))
        out[family] = path
    return out
