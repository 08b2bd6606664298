"""Write the embedded default model as a real Hugging Face model directory.

The model is a tiny Llama (4 layers, hidden 256, 4 query / 2 KV heads,
head_dim 64, tied embeddings, 2048 positions) whose weights are RANDOM,
drawn from a fixed seed: it exercises the whole serving path (loader,
tokenizer, chat template, cache, sampler) on any CPU in milliseconds per
token, but its text is gibberish. Every byte written is deterministic, so two
creations give identical directories.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from paged_server.default_model.tokenizer_builder import (
    ENDOFTEXT,
    IM_END,
    build_tokenizer,
)

SEED = 0
INIT_STD = 0.02

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "dtype": "float32",
}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_default_model(directory: Path) -> None:
    """Create config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json and generation_config.json in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(CONFIG["vocab_size"])
    assert tokenizer.get_vocab_size() == CONFIG["vocab_size"]
    endoftext, im_end = tokenizer.token_to_id(ENDOFTEXT), tokenizer.token_to_id(IM_END)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {**CONFIG, "bos_token_id": None, "eos_token_id": im_end, "pad_token_id": endoftext}
    _write_json(directory / "config.json", config)
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "unk_token": None,
            "add_bos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": CONFIG["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        directory / "generation_config.json",
        {"eos_token_id": [im_end, endoftext], "pad_token_id": endoftext},
    )
    save_file(random_weights(), str(directory / "model.safetensors"), metadata={"format": "pt"})


def random_weights() -> dict[str, torch.Tensor]:
    """Llama weights under Hugging Face names: N(0, 0.02) matrices from a
    seeded generator, norms at one; no lm_head (tied to the embeddings)."""
    c = CONFIG
    gen = torch.Generator().manual_seed(SEED)
    h, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_dim, kv_dim = c["num_attention_heads"] * d, c["num_key_value_heads"] * d

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * INIT_STD

    weights = {"model.embed_tokens.weight": normal(c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = normal(q_dim, h)
        weights[p + "self_attn.k_proj.weight"] = normal(kv_dim, h)
        weights[p + "self_attn.v_proj.weight"] = normal(kv_dim, h)
        weights[p + "self_attn.o_proj.weight"] = normal(h, q_dim)
        weights[p + "mlp.gate_proj.weight"] = normal(inter, h)
        weights[p + "mlp.up_proj.weight"] = normal(inter, h)
        weights[p + "mlp.down_proj.weight"] = normal(h, inter)
        weights[p + "input_layernorm.weight"] = torch.ones(h)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(h)
    weights["model.norm.weight"] = torch.ones(h)
    return weights


def _write_json(file: Path, data: dict[str, Any]) -> None:
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
