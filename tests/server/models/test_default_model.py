"""The embedded default model: byte-identical on every creation, created once
per cache folder, and a working Hugging Face directory (our loader and
transformers agree on it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from paged_server.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from paged_server.models import load_model

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory):
    return ensure_default_model(tmp_path_factory.mktemp("cache"))


def test_two_creations_are_byte_identical(default_dir, tmp_path):
    # The second creation runs in a fresh interpreter with another hash seed.
    other_root = tmp_path / "other"
    code = "import sys; from paged_server.default_model import ensure_default_model as e; e(sys.argv[1])"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", code, str(other_root)], check=True, env=env)
    other = other_root / DEFAULT_MODEL_NAME
    assert sorted(p.name for p in other.iterdir()) == sorted(FILES)
    for name in FILES:
        assert (other / name).read_bytes() == (default_dir / name).read_bytes(), name


def test_cache_dir_from_env_and_created_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path))
    path = ensure_default_model()
    assert path == tmp_path / DEFAULT_MODEL_NAME
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_MODEL_NAME]  # no temp dirs left


def test_a_half_written_model_is_replaced(tmp_path):
    broken = tmp_path / DEFAULT_MODEL_NAME
    broken.mkdir()
    (broken / "config.json").write_text("{")
    path = ensure_default_model(tmp_path)
    assert load_model(path).config.num_layers == 4


@torch.no_grad()
def test_loads_serves_chat_and_matches_transformers(default_dir, pool_of, greedy_pool):
    loaded = load_model(default_dir)
    c = loaded.config
    assert c.architecture == "LlamaForCausalLM" and c.tie_word_embeddings
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.max_position_embeddings) == (4, 2, 64, 2048)
    tok = loaded.tokenizer
    assert loaded.eos_token_ids == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is a list?"}], tokenize=True
    )
    assert tok.decode(prompt, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    tokens, _ = greedy_pool(loaded.model, pool_of("contiguous", loaded), prompt, 16)
    hf = AutoModelForCausalLM.from_pretrained(default_dir).eval()
    expected = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=16,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert tokens == expected[0, len(prompt) :].tolist()
    assert isinstance(tok.decode(tokens), str)


def test_training_script_writes_a_loadable_trained_model(tmp_path, monkeypatch, default_dir):
    from paged_server.default_model.train import train

    monkeypatch.setenv("PAGED_CACHE_DIR", str(default_dir.parent))
    out = tmp_path / "trained"
    # the real corpus (~20 s to read and tokenize), on whatever stdlib this Python has
    losses = train(out, steps=3, batch_size=2, seq_len=16, strict_corpus=False)
    assert len(losses) == 3 and all(loss == loss for loss in losses)  # finite, not NaN
    streams = json.loads((out / "training.json").read_text())["stream_tokens"]
    assert streams["stdlib"] > 1_000_000 and streams["docstrings"] > 100_000
    trained, random = load_model(out), load_model(default_dir)
    assert trained.config == random.config
    assert not torch.equal(
        trained.model.model.embed_tokens.weight, random.model.model.embed_tokens.weight
    )
