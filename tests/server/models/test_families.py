"""What the families add beyond parity: sharded checkpoints, the README's
list of architectures, config fields older checkpoints spell differently,
Phi-3's longrope on both sides of its original context, and the refusals
a user meets (an unsupported architecture, quantized experts)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from paged_server.models import (
    SUPPORTED_ARCHITECTURES,
    InvalidConfigError,
    ModelConfig,
    UnsupportedArchitectureError,
    load_model,
)
from paged_server.models.rope import RotaryEmbedding

README = Path(__file__).parents[3] / "README.md"


@pytest.mark.parametrize("family", ["phi3", "mixtral"])
def test_sharded_checkpoint_loads_like_one_file(checkpoints, prompt_of, tmp_path, family):
    ckpt = checkpoints[family]
    path = tmp_path / family
    ckpt.hf_model.save_pretrained(path, max_shard_size="100KB")
    shutil.copy(ckpt.path / "tokenizer.json", path)
    assert len(list(path.glob("*.safetensors"))) > 2
    assert (path / "model.safetensors.index.json").is_file()
    prompt = torch.tensor([prompt_of(11, 9)])
    with torch.no_grad():
        sharded = load_model(path).model(prompt, torch.arange(11)[None])
        whole = ckpt.loaded.model(prompt, torch.arange(11)[None])
    torch.testing.assert_close(sharded, whole, rtol=0, atol=0)


def test_readme_lists_exactly_the_supported_architectures_and_the_refusal_names_them(
    checkpoints, tmp_path
):
    text = README.read_text(encoding="utf-8")
    section = text.split("### Supported architectures", 1)[1].split("\n#", 1)[0]
    listed = re.findall(r"^- `(\w+)`", section, flags=re.M)
    assert listed == sorted(listed) and set(listed) == set(SUPPORTED_ARCHITECTURES)
    path = tmp_path / "gpt2"
    shutil.copytree(checkpoints["llama"].path, path)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_model(path)
    assert str(err.value).endswith("supported: " + ", ".join(sorted(listed)))


def _config(**fields):
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=4,
                num_attention_heads=2)  # fmt: skip
    return ModelConfig.from_hf({**base, **fields}, "test")


def test_windows_from_each_familys_config_fields():
    # Mistral/Mixtral/Phi-3: sliding_window applies to every layer; null: none.
    assert _config(model_type="mistral", sliding_window=4096).layer_sliding_windows == [4096] * 4
    assert _config(model_type="mixtral", sliding_window=None).layer_sliding_windows == [None] * 4
    # Gemma 2 before layer_types: even layers slide.
    gemma2 = _config(model_type="gemma2", sliding_window=4096)
    assert gemma2.layer_sliding_windows == [4096, None, 4096, None]
    # Qwen 2.5 ships a sliding_window it does not use.
    qwen2 = _config(model_type="qwen2", sliding_window=32768, use_sliding_window=False)
    assert qwen2.layer_sliding_windows == [None] * 4


def test_moe_layers_follow_step_and_dense_list():
    c = _config(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=4, decoder_sparse_step=2, mlp_only_layers=[3])  # fmt: skip
    assert [c.layer_is_moe(i) for i in range(4)] == [False, True, False, False]
    assert _config(model_type="llama").layer_is_moe(0) is False


def test_su_is_longrope_and_factor_defaults_to_the_context_ratio():
    rope = {"type": "su", "short_factor": [1.0] * 2, "long_factor": [2.0] * 2}
    c = _config(max_position_embeddings=4096, original_max_position_embeddings=1024,
                rope_scaling=rope)  # fmt: skip
    assert c.rope.rope_type == "longrope" and c.rope.factor == 4.0
    assert c.rope.original_max_position_embeddings == 1024
    with pytest.raises(InvalidConfigError, match="original_max_position_embeddings"):
        _config(rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]})


@pytest.mark.parametrize("long", [False, True])
def test_longrope_angles_equal_transformers_below_and_past_the_original_context(checkpoints, long):
    """transformers picks the long factors for a whole pass once a position
    reaches the original context; ours picks them per position, so a pass
    entirely on one side agrees with it exactly."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    ckpt = checkpoints["phi3"]
    c = ckpt.loaded.config
    orig = c.rope.original_max_position_embeddings
    positions = torch.arange(orig, orig + 20)[None] if long else torch.arange(20)[None]
    theirs = Phi3RotaryEmbedding(ckpt.hf_model.config)
    x = torch.zeros(1, 20, c.hidden_size)
    cos_t, sin_t = theirs(x, positions)
    cos, sin = RotaryEmbedding(c.rope, c.head_dim, c.max_position_embeddings)(
        positions, torch.float32
    )
    torch.testing.assert_close(cos, cos_t, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, sin_t, rtol=0, atol=1e-6)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_experts_are_refused_clearly(checkpoints, quantization):
    with pytest.raises(InvalidConfigError, match="mixture-of-experts"):
        load_model(checkpoints["mixtral"].path, quantization=quantization)


def test_stacked_quantized_checkpoint_computes_its_dequantized_weights(checkpoints, tmp_path):
    """Phi-3 stores q/k/v and gate/up stacked: an FP8 (compressed-tensors,
    per-channel) copy of it loads as ``QuantizedLinear`` layers that compute
    what the dense model with the dequantized weights computes."""
    from safetensors.torch import load_file, save_file

    from paged_server.models.quantization import QuantizedLinear

    src = checkpoints["phi3"].path
    quant, fake = tmp_path / "fp8", tmp_path / "dequantized"
    shutil.copytree(src, quant)
    shutil.copytree(src, fake)
    state = load_file(str(src / "model.safetensors"))
    quantized, dequantized = dict(state), dict(state)
    for key in [k for k in state if k.endswith("proj.weight")]:
        w = state[key].float()
        scale = w.abs().amax(1, keepdim=True) / 448.0
        codes = (w / scale).to(torch.float8_e4m3fn)
        quantized[key], quantized[key.removesuffix("weight") + "weight_scale"] = codes, scale
        dequantized[key] = codes.float() * scale
    save_file(quantized, str(quant / "model.safetensors"))
    save_file(dequantized, str(fake / "model.safetensors"))
    config = json.loads((quant / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized"}
    (quant / "config.json").write_text(json.dumps(config))
    q, d = load_model(quant), load_model(fake)
    attn = q.model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, QuantizedLinear) and len(attn.qkv_proj.slices) == 3
    ids = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = q.model(ids, torch.arange(12)[None]), d.model(ids, torch.arange(12)[None])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
