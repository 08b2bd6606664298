"""Gemma 3's sliding-window layers really forget what lies past the window,
with and without a cache, and agree with transformers well past it."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from paged_server.models import load_model

WINDOW = 4


@pytest.fixture(scope="module")
def sliding_only(tmp_path_factory, tokenizer_json):
    """One sliding layer: the last position can only see the last WINDOW tokens."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention"],
        max_position_embeddings=256,
        initializer_range=0.1,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    hf = Gemma3ForCausalLM._from_config(config, attn_implementation="eager").eval()
    path = tmp_path_factory.mktemp("gemma3-sliding")
    hf.save_pretrained(path)
    (path / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    return hf, load_model(path)


@torch.no_grad()
@pytest.mark.parametrize("kind", [None, "contiguous", "paged"])
def test_tokens_past_the_window_do_not_matter(sliding_only, kind, pool_of, prompt_of):
    _, loaded = sliding_only
    prompt = prompt_of(12, 7)

    def last_logits(tokens):
        ids, pos = torch.tensor(tokens), torch.arange(len(tokens))
        if kind is None:
            return loaded.model(ids[None], pos[None])[0, -1]
        pool = pool_of(kind, loaded, enable_prefix_caching=False)
        view = pool.prefill_view(pool.allocate_sequence(tokens)[0])
        return loaded.model(ids, pos, view)[-1]

    base = last_logits(prompt)
    far = list(prompt)
    far[len(prompt) - WINDOW - 1] = (far[len(prompt) - WINDOW - 1] + 1) % 512  # just outside
    near = list(prompt)
    near[len(prompt) - WINDOW] = (near[len(prompt) - WINDOW] + 1) % 512  # oldest visible
    torch.testing.assert_close(last_logits(far), base, atol=0, rtol=0)
    assert not torch.allclose(last_logits(near), base)


@torch.no_grad()
def test_decode_past_the_window_matches_transformers(sliding_only, pool_of, greedy_pool, prompt_of):
    hf, loaded = sliding_only
    prompt = prompt_of(3, 8)  # shorter than the window: decoding crosses it
    tokens, step_logits = greedy_pool(loaded.model, pool_of("paged", loaded), prompt, 16)
    expected = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    torch.testing.assert_close(torch.stack(step_logits), expected, atol=1e-4, rtol=0)
