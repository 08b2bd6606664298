"""The loader on real checkpoint directories: shards, tied embeddings, dtypes,
older config formats, and an error that says what is wrong for each broken
directory."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from paged_server.models import (
    SUPPORTED_ARCHITECTURES,
    CheckpointMismatchError,
    ModelConfig,
    ModelFileNotFoundError,
    UnsupportedArchitectureError,
    load_model,
)
from paged_server.models.registry import ARCHITECTURES


@pytest.fixture
def llama_copy(checkpoints, tmp_path):
    """A private copy of the Llama checkpoint a test may break."""
    path = tmp_path / "llama"
    shutil.copytree(checkpoints["llama"].path, path)
    return path


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_directory(tmp_path):
    with pytest.raises(ModelFileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(llama_copy):
    (llama_copy / "config.json").unlink()
    with pytest.raises(ModelFileNotFoundError, match=r"config\.json not found"):
        load_model(llama_copy)


def test_missing_weights(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(ModelFileNotFoundError, match=r"no \*\.safetensors weights"):
        load_model(llama_copy)


def test_missing_shard(checkpoints, tmp_path):
    path = tmp_path / "sharded"
    checkpoints["llama"].hf_model.save_pretrained(path, max_shard_size="100KB")
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (path / "model.safetensors.index.json").is_file()
    shards[-1].unlink()
    with pytest.raises(ModelFileNotFoundError, match=f"not there: {shards[-1].name}"):
        load_model(path)


def test_missing_tokenizer(llama_copy):
    (llama_copy / "tokenizer.json").unlink()
    with pytest.raises(ModelFileNotFoundError, match=r"tokenizer\.json not found"):
        load_model(llama_copy)


def test_unsupported_architecture_names_it_and_the_supported_ones(llama_copy):
    _edit_config(llama_copy, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_model(llama_copy)
    assert "GPT2LMHeadModel" in str(err.value)
    for name in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"):
        assert name in str(err.value)
        assert name in SUPPORTED_ARCHITECTURES


def test_shape_mismatch_names_the_weight_and_both_shapes(llama_copy):
    _edit_config(llama_copy, intermediate_size=96)
    with pytest.raises(CheckpointMismatchError) as err:
        load_model(llama_copy)
    message = str(err.value)
    assert "mlp." in message  # names the tensor
    assert ("(128, 64)" in message and "(96, 64)" in message) or (
        "(64, 128)" in message and "(64, 96)" in message
    )


def test_missing_tensor_is_named(llama_copy):
    weights = load_file(llama_copy / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, llama_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatchError, match=r"model\.layers\.1\.self_attn\.k_proj"):
        load_model(llama_copy)


@torch.no_grad()
def test_sharded_checkpoint_loads_like_the_single_file(checkpoints, tmp_path):
    path = tmp_path / "sharded"
    checkpoints["qwen3"].hf_model.save_pretrained(path, max_shard_size="100KB")
    assert len(list(path.glob("model-*.safetensors"))) > 1
    shutil.copy(checkpoints["qwen3"].path / "tokenizer.json", path)
    ids = torch.arange(3, 20)[None]
    pos = torch.arange(17)[None]
    sharded = load_model(path).model(ids, pos)
    torch.testing.assert_close(sharded, checkpoints["qwen3"].loaded.model(ids, pos), atol=0, rtol=0)


def test_tied_embeddings_share_one_tensor(checkpoints):
    gemma = checkpoints["gemma3"].loaded.model
    llama = checkpoints["llama"].loaded.model
    assert gemma.lm_head.weight.data_ptr() == gemma.model.embed_tokens.weight.data_ptr()
    assert llama.lm_head.weight.data_ptr() != llama.model.embed_tokens.weight.data_ptr()


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "auto"])
def test_dtype_conversion(checkpoints, dtype):
    ckpt = checkpoints["llama"]
    loaded = load_model(ckpt.path, dtype=dtype)
    expected = torch.float32 if dtype == "auto" else dtype  # the checkpoint is float32
    assert loaded.dtype == expected
    assert {p.dtype for p in loaded.model.parameters()} == {expected}
    ids, pos = torch.arange(3, 15)[None], torch.arange(12)[None]
    logits = loaded.model(ids, pos)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, ckpt.loaded.model(ids, pos), atol=0.1, rtol=0.05)


def test_eos_ids_from_generation_config_then_tokenizer(llama_copy):
    (llama_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    (llama_copy / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    _edit_config(llama_copy, eos_token_id=9)
    loaded = load_model(llama_copy)
    im_end = loaded.tokenizer.token_to_id("<|im_end|>")
    assert loaded.eos_token_ids == [7, 9, im_end]


def test_old_and_new_config_formats_agree(checkpoints):
    llama_new = json.loads((checkpoints["llama"].path / "config.json").read_text())
    llama_old = {k: v for k, v in llama_new.items() if k != "rope_parameters"}
    rope = dict(llama_new["rope_parameters"])
    llama_old["rope_theta"] = rope.pop("rope_theta")
    llama_old["rope_scaling"] = rope
    assert ModelConfig.from_hf(llama_old, "LlamaForCausalLM") == ModelConfig.from_hf(
        llama_new, "LlamaForCausalLM"
    )
    gemma_new = json.loads((checkpoints["gemma3"].path / "config.json").read_text())
    gemma_old = {k: v for k, v in gemma_new.items() if k not in ("rope_parameters", "layer_types")}
    gemma_old.update(
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, sliding_window_pattern=2
    )
    old = ModelConfig.from_hf(gemma_old, "Gemma3ForCausalLM")
    new = ModelConfig.from_hf(gemma_new, "Gemma3ForCausalLM")
    assert old == new
    assert new.layer_sliding_windows == [8, None, 8]
    assert (new.rope.theta, new.local_rope.theta) == (1_000_000.0, 10_000.0)


def test_gemma3_multimodal_names_map_onto_the_text_model(checkpoints):
    arch = ARCHITECTURES["Gemma3ForConditionalGeneration"]
    assert arch.weight_name("model.language_model.layers.0.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    assert arch.weight_name("language_model.model.norm.weight") == "model.norm.weight"
    assert arch.weight_name("model.vision_tower.encoder.x.weight") is None
    hf = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "eos_token_id": [1, 106],
        "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
    }
    text = arch.text_config(hf)
    config = ModelConfig.from_hf(text, "Gemma3ForConditionalGeneration")
    assert config.eos_token_ids == [1, 106] and config.head_dim == 256  # Gemma 3 defaults


@torch.no_grad()
def test_gemma3_multimodal_checkpoint_runs_its_text_model(tmp_path, tokenizer_json, prompt_of):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    config = Gemma3Config(
        text_config=dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
            max_position_embeddings=256,
        ),
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
        image_token_index=500,
        boi_token_index=498,
        eoi_token_index=499,
    )
    hf = Gemma3ForConditionalGeneration._from_config(config, attn_implementation="eager").eval()
    for p in hf.parameters():
        if p.ndim == 1:
            p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    loaded = load_model(tmp_path)  # vision tower weights are skipped, not errors
    assert loaded.config.architecture == "Gemma3ForConditionalGeneration"
    ids = torch.tensor([prompt_of(12, 9)])
    ours = loaded.model(ids, torch.arange(12)[None])
    torch.testing.assert_close(ours, hf(input_ids=ids).logits, atol=1e-4, rtol=0)
