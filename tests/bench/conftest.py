"""A tiny random Llama checkpoint (transformers save_pretrained + the embedded
model's tokenizer) shared by the bench tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from paged_server.default_model import ensure_default_model

    tok_dir = ensure_default_model()  # shared cache: built once per machine
    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok_dir / name, out / name)
    return out
