"""Layer-level checks against transformers' own functions: RoPE frequencies
with each scaling rule, and attention soft-capping (which no released Gemma 3
config enables, so the end-to-end parity tests cannot see it)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward

from paged_server.models import ModelConfig, load_model
from paged_server.models.layers import causal_attention
from paged_server.models.rope import rope_inv_freq

LLAMA31_ROPE = {  # Llama 3.1/3.2's published values
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "rope",
    [LLAMA31_ROPE, {"rope_type": "linear", "rope_theta": 10_000.0, "factor": 8.0}],
    ids=["llama3", "linear"],
)
def test_rope_frequencies_match_transformers(rope):
    hf = LlamaConfig(
        hidden_size=2048,
        num_attention_heads=32,
        head_dim=64,
        max_position_embeddings=131_072,
        rope_parameters=dict(rope),
    )
    expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    ours = ModelConfig.from_hf(hf.to_dict(), "LlamaForCausalLM")
    got = rope_inv_freq(ours.rope, ours.head_dim, ours.max_position_embeddings)
    torch.testing.assert_close(got, expected, atol=0, rtol=1e-6)
    plain = rope_inv_freq(
        ModelConfig.from_hf(
            {**hf.to_dict(), "rope_parameters": {"rope_theta": rope["rope_theta"]}},
            "LlamaForCausalLM",
        ).rope,
        64,
        131_072,
    )
    assert not torch.allclose(got, plain)  # the scaling changed something


class _Module(torch.nn.Module):
    num_key_value_groups = 2
    head_dim = 16


@pytest.mark.parametrize("window", [None, 3])
def test_softcapped_attention_matches_transformers_eager(window):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 7, 16, generator=gen) * 3  # large scores so the cap bites
    k = torch.randn(2, 2, 7, 16, generator=gen) * 3
    v = torch.randn(2, 2, 7, 16, generator=gen)
    i, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    visible = (j <= i) & ((j > i - window) if window else True)
    mask = torch.zeros(7, 7).masked_fill(~visible, float("-inf"))
    expected, _ = eager_attention_forward(_Module(), q, k, v, mask, scaling=0.25, softcap=5.0)
    # ours takes [batch, length, heads, head_dim], as the model's projections give it
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    ours = causal_attention(q, k, v, scale=0.25, sliding_window=window, softcap=5.0)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    uncapped = causal_attention(q, k, v, scale=0.25, sliding_window=window)
    assert not torch.allclose(ours, uncapped, atol=1e-3)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_attention_softcap_reaches_the_cache_views(checkpoints, tmp_path, kind, pool_of, prompt_of):
    path = tmp_path / "gemma-capped"
    shutil.copytree(checkpoints["gemma3"].path, path)
    config = json.loads((path / "config.json").read_text())
    config["attn_logit_softcapping"] = 0.5  # tiny cap: changes every score
    (path / "config.json").write_text(json.dumps(config))
    capped = load_model(path)
    prompt = prompt_of(10, 3)
    ids, pos = torch.tensor([prompt]), torch.arange(10)[None]
    reference = capped.model(ids, pos)
    assert not torch.allclose(reference, checkpoints["gemma3"].loaded.model(ids, pos), atol=1e-3)
    pool = pool_of(kind, capped)
    seq_id, _ = pool.allocate_sequence(prompt[:6])
    view = pool.prefill_view(seq_id)
    logits = [capped.model(ids[0, :6], pos[0, :6], view)]
    view.advance(6)
    for t in range(6, 10):
        pool.append_token(seq_id, prompt[t])
        view = pool.decode_view([seq_id])
        logits.append(capped.model(ids[0, t : t + 1], pos[0, t : t + 1], view))
        view.advance(1)
    torch.testing.assert_close(torch.cat(logits), reference[0], atol=1e-5, rtol=0)
