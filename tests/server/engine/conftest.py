"""A tiny real checkpoint (Llama, saved by transformers as safetensors with a
real byte-level BPE tokenizer) and helpers to drive an engine to completion.

The weights use a wide random init so greedy outputs depend on the whole
context (a near-uniform model repeats one token whatever the cache holds,
which would let cache bugs pass). Helpers are fixtures returning functions
because tests are imported with importlib, not as a package.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from paged_server.config import EngineConfig
from paged_server.default_model.tokenizer_builder import build_tokenizer
from paged_server.engine.core.llm_engine import LLMEngine
from paged_server.models import LoadedModel, load_model
from paged_server.sampling_params import SamplingParams

VOCAB = 512  # prompt_of (tests/server/conftest.py) draws ids below this
EOS = 0  # <|endoftext|> in the default model's tokenizer
CYCLE = 6  # cycling_model_dir's token cycles


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("engine-ckpt")
    build_tokenizer(VOCAB).save(str(path / "tokenizer.json"))
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.3,
        eos_token_id=EOS,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir: Path) -> LoadedModel:
    """Loaded once (float32, CPU) and shared: models hold no per-request state."""
    return load_model(tiny_model_dir, torch.float32, "cpu")


@pytest.fixture(scope="session")
def tiny_hybrid_loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A tiny Gemma 3 with real Gemma 3's mix of layers: sliding-window ones
    (window 8) around a global one, so its paged pool has one full KV cache
    group and three sliding ones sharing the blocks."""
    return tiny_gemma3(tmp_path_factory.mktemp("engine-hybrid-ckpt"), ["sliding", "full", "sliding", "sliding"])


@pytest.fixture(scope="session")
def tiny_sliding_loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny Gemma 3 with every layer sliding (window 8): one KV cache
    group that holds a window per sequence, however long it grows."""
    return tiny_gemma3(tmp_path_factory.mktemp("engine-sliding-ckpt"), ["sliding"] * 4)


def tiny_gemma3(path: Path, layers: list[str]) -> LoadedModel:
    """A tiny Gemma 3 saved to ``path`` with these layer kinds, loaded."""
    build_tokenizer(VOCAB).save(str(path / "tokenizer.json"))
    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layers),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        layer_types=[f"{kind}_attention" for kind in layers],
        max_position_embeddings=512, initializer_range=0.3, query_pre_attn_scalar=16,
        eos_token_id=EOS, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(path)
    return load_model(path, torch.float32, "cpu")


@pytest.fixture(scope="session")
def cycling_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose next token is mostly a fixed successor of the
    current one (the LM head is the embeddings permuted in cycles of 6), so
    its output settles into cycles that prompt lookup can copy; attention and
    the MLP still add a tenth of their usual part, so the cache matters to
    every logit (and to the logprobs compared with it). Same tokenizer as
    ``tiny_model_dir``'s: either can draft for the other."""
    path = tmp_path_factory.mktemp("cycling")
    build_tokenizer(VOCAB).save(str(path / "tokenizer.json"))
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        initializer_range=0.3, eos_token_id=EOS, bos_token_id=None, pad_token_id=None,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight *= 0.01
            layer.mlp.down_proj.weight *= 0.01
        unit = torch.nn.functional.normalize(model.model.embed_tokens.weight, dim=-1)
        token = torch.arange(VOCAB)
        base = token - token % CYCLE
        size = (VOCAB - base).clamp(max=CYCLE)  # the last cycle is shorter
        successor = base + (token - base + 1) % size
        head = torch.empty_like(unit)
        head[successor] = unit * 12.0  # row successor[t] points along token t's embedding
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def cycling_loaded(cycling_model_dir: Path) -> LoadedModel:
    return load_model(cycling_model_dir, torch.float32, "cpu")


@pytest.fixture
def make_cycling(cycling_loaded: LoadedModel) -> Callable[..., LLMEngine]:
    """``make_cycling(**config)``: an engine on the cycling model, small defaults."""

    def make(**overrides: Any) -> LLMEngine:
        cfg: dict[str, Any] = dict(
            max_batch_size=8, max_model_len=128, max_num_batched_tokens=256, block_size=4,
            device="cpu", attention_backend="ref",
        )  # fmt: skip
        return LLMEngine(EngineConfig(**{**cfg, **overrides}), cycling_loaded)

    return make


@pytest.fixture
def make_engine(tiny_loaded: LoadedModel) -> Callable[..., LLMEngine]:
    """``make_engine(**config)``: an engine on the tiny model, small defaults."""

    def make(**overrides: Any) -> LLMEngine:
        cfg: dict[str, Any] = dict(
            max_batch_size=8,
            max_model_len=128,
            max_num_batched_tokens=256,
            block_size=4,
            device="cpu",
            attention_backend="ref",
        )
        cfg.update(overrides)
        return LLMEngine(EngineConfig(**cfg), tiny_loaded)

    return make


@dataclass
class Choice:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_outputs: int = 0


@dataclass
class Run:
    """Everything streamed by one drive of the engine."""

    choices: dict[tuple[str, int], Choice]
    steps: int
    # step number at which each (request, choice) first produced a token
    first_token_step: dict[tuple[str, int], int]

    def tokens(self, request_id: str, index: int = 0) -> list[int]:
        return self.choices[(request_id, index)].token_ids


def drive(
    engine: LLMEngine,
    requests: list[tuple[str, list[int] | str, SamplingParams]] = (),  # type: ignore[assignment]
    max_steps: int = 5000,
    on_step: Callable[[int, LLMEngine], None] | None = None,
    resumed: bool = False,
) -> Run:
    """Submit ``requests`` and step until the engine is idle; fails on a stall
    (more than ``max_steps`` steps) and checks invariants of the stream.
    ``resumed``: the caller already stepped, so token counts start mid-stream."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    choices: dict[tuple[str, int], Choice] = {}
    first: dict[tuple[str, int], int] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        assert steps <= max_steps, f"engine did not finish within {max_steps} steps"
        for out in engine.step():
            key = (out.request_id, out.index)
            choice = choices.setdefault(key, Choice())
            assert choice.finish_reason is None, f"{key} produced output after finishing"
            choice.token_ids += out.new_token_ids
            choice.text += out.new_text
            choice.logprobs += out.new_logprobs or []
            choice.num_outputs += 1
            if not resumed:
                assert out.num_generated_tokens == len(choice.token_ids)
            if out.new_token_ids and key not in first:
                first[key] = steps
            if out.finished:
                choice.finish_reason, choice.error = out.finish_reason, out.error
        if on_step is not None:
            on_step(steps, engine)
    return Run(choices, steps, first)


@pytest.fixture
def run_engine() -> Callable[..., Run]:
    """``run_engine(engine, requests, max_steps=...)`` -> ``Run``."""
    return drive


@pytest.fixture
def greedy() -> Callable[..., SamplingParams]:
    def make(max_tokens: int = 12, **kw: Any) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)

    return make
