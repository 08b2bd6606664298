"""Tiny random checkpoints of each family, built once per session with
transformers (the parity oracle) and saved as real safetensors directories.

Weights are transformers' random init with larger spread, and every norm
weight perturbed, so that each norm, scale and RoPE detail shows in the
logits. Helpers that several test files share are fixtures returning
functions (tests are imported with importlib, not as a package).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

from paged_core import kv_cache_groups
from paged_core.attention_backend import AttentionBackend
from paged_server import attention_backends
from paged_server.default_model.tokenizer_builder import build_tokenizer
from paged_server.models import LoadedModel, load_model

VOCAB = 512  # prompt_of (tests/server/conftest.py) draws ids below this
FAMILIES = ("llama", "qwen3", "gemma3")  # the fixtures most model tests run on
# Every supported family: the parity tests run them all.
ALL_FAMILIES = FAMILIES + ("mistral", "qwen2", "gemma2", "phi3", "mixtral", "qwen3_moe")
GEMMA_WINDOW = 8
PHI3_ORIGINAL_CONTEXT = 64  # longrope: short factors below, long ones from here on

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    max_position_embeddings=256,
    initializer_range=0.1,
    eos_token_id=None,  # greedy runs the full 32 tokens in both implementations
    bos_token_id=None,
    pad_token_id=None,
)


def _hf_config(family: str) -> Any:
    if family == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # small, so all three frequency bands (kept, scaled, smoothed) occur
            "original_max_position_embeddings": 32,
        }
        return LlamaConfig(num_hidden_layers=2, rope_parameters=rope, **_COMMON)
    if family == "qwen3":
        return Qwen3Config(num_hidden_layers=2, head_dim=32, **_COMMON)
    if family == "mistral":  # a window on every layer
        return transformers.MistralConfig(num_hidden_layers=2, sliding_window=GEMMA_WINDOW, **_COMMON)
    if family == "qwen2":  # biases on q/k/v only
        return transformers.Qwen2Config(num_hidden_layers=2, **_COMMON)
    if family == "gemma2":  # both soft-caps, alternating windows, no q/k norms
        return transformers.Gemma2Config(
            num_hidden_layers=3, head_dim=16, sliding_window=GEMMA_WINDOW,
            attn_logit_softcapping=1.5, final_logit_softcapping=2.0, query_pre_attn_scalar=24,
            **_COMMON,
        )  # fmt: skip
    if family == "phi3":  # head_dim 96 (as published), longrope
        half = 48
        rope = {
            "rope_type": "longrope", "rope_theta": 10_000.0,
            "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.0 + 0.5 * i for i in range(half)],
            "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT,
            "factor": _COMMON["max_position_embeddings"] / PHI3_ORIGINAL_CONTEXT,
        }  # fmt: skip
        common = {**_COMMON, "hidden_size": 192, "num_attention_heads": 2, "num_key_value_heads": 1}
        return transformers.Phi3Config(
            num_hidden_layers=2, rope_parameters=rope,
            original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT, **common,
        )  # fmt: skip
    if family == "mixtral":
        return transformers.MixtralConfig(
            num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, **_COMMON
        )
    if family == "qwen3_moe":  # layer 1 dense (mlp_only_layers), top-2 of 4 renormalized
        return transformers.Qwen3MoeConfig(
            num_hidden_layers=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1], **_COMMON,
        )  # fmt: skip
    return Gemma3TextConfig(
        num_hidden_layers=3,
        head_dim=16,
        sliding_window=GEMMA_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=2.0,
        query_pre_attn_scalar=24,
        **_COMMON,
    )


_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


@dataclass
class Checkpoint:
    family: str
    path: Path
    hf_model: Any  # the transformers model the directory was saved from
    loaded: LoadedModel  # our loader's result (float32, CPU)


def build_hf_model(family: str, seed: int = 0) -> Any:
    """A random transformers model of ``family`` (eager attention: the oracle)."""
    torch.manual_seed(seed)
    config = _hf_config(family)
    hf_class = getattr(transformers, _HF_CLASSES[family])
    model = hf_class._from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norms: HF inits them to the identity
                p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 512-token byte-level BPE, copied next to every tiny checkpoint."""
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    build_tokenizer(VOCAB).save(str(path))
    return path


class _Checkpoints(dict):  # type: ignore[type-arg]
    """family -> ``Checkpoint``, each saved and loaded on first use."""

    def __init__(self, factory: pytest.TempPathFactory, tokenizer_json: Path) -> None:
        super().__init__()
        self.factory, self.tokenizer_json = factory, tokenizer_json

    def __missing__(self, family: str) -> Checkpoint:
        hf_model = build_hf_model(family)
        path = self.factory.mktemp(f"ckpt-{family}")
        hf_model.save_pretrained(path)
        (path / "tokenizer.json").write_bytes(self.tokenizer_json.read_bytes())
        self[family] = Checkpoint(family, path, hf_model, load_model(path))
        return self[family]


@pytest.fixture(scope="session")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_json: Path
) -> dict[str, Checkpoint]:
    """One saved checkpoint per family (built when first asked for), loaded
    with our loader."""
    return _Checkpoints(tmp_path_factory, tokenizer_json)


@pytest.fixture(params=FAMILIES)
def checkpoint(request: pytest.FixtureRequest, checkpoints: dict[str, Checkpoint]) -> Checkpoint:
    return checkpoints[request.param]


@pytest.fixture(params=ALL_FAMILIES)
def any_checkpoint(
    request: pytest.FixtureRequest, checkpoints: dict[str, Checkpoint]
) -> Checkpoint:
    """Every supported family's checkpoint in turn (the parity tests)."""
    return checkpoints[request.param]


def make_pool(kind: str, loaded: LoadedModel, ops: AttentionBackend | None = None, **kw: Any) -> Any:
    """A float32 CPU pool sized for the tiny models: ``contiguous`` or ``paged``
    (block size 4, so sequences span many blocks and windows cross blocks)."""
    from paged_ref import ContiguousKVPool, PagedKVPool

    c = loaded.config
    if kind == "contiguous":
        return ContiguousKVPool.from_model_config(
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            max_model_len=128,
            max_batch_size=4,
            dtype=torch.float32,
        )
    return PagedKVPool.from_model_config(
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
        num_blocks=kw.get("num_blocks", 96),
        block_size=kw.get("block_size", 4),
        dtype=torch.float32,
        ops=ops,
        enable_prefix_caching=kw.get("enable_prefix_caching", True),
        groups=kv_cache_groups(c.layer_sliding_windows),  # Gemma 3: hybrid KV cache groups
    )


@pytest.fixture
def pool_of() -> Callable[..., Any]:
    """``pool_of(kind, loaded, ops=None)``: see ``make_pool``."""
    return make_pool


def attention_ops(backend: str) -> AttentionBackend:
    """The paged pool's attention backend for the backend under test, as the
    engine builds it (``attention_backends.build``)."""
    if backend == "triton":
        import paged_triton

        if not paged_triton.is_available():
            pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    return attention_backends.build(backend)


@pytest.fixture
def ops_for() -> Callable[[str], AttentionBackend]:
    return attention_ops


@torch.no_grad()
def greedy_with_pool(
    model: torch.nn.Module, pool: Any, prompt: list[int], steps: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill ``prompt`` through ``pool`` then decode ``steps`` greedy tokens
    one at a time; returns the tokens and each step's last-position logits."""
    seq_id, cached = pool.allocate_sequence(prompt)
    new = prompt[cached:]
    view = pool.prefill_view(seq_id)
    logits = model(torch.tensor(new), torch.arange(cached, len(prompt)), view)[-1]
    view.advance(len(new))
    tokens, step_logits = [], [logits]
    for _ in range(steps):
        token = int(logits.argmax())
        tokens.append(token)
        if len(tokens) == steps:
            break
        pool.append_token(seq_id, token)
        position = len(prompt) + len(tokens) - 1
        view = pool.decode_view([seq_id])
        logits = model(torch.tensor([token]), torch.tensor([position]), view)[-1]
        view.advance(1)
        step_logits.append(logits)
    pool.free_seq(seq_id)
    return tokens, step_logits


@pytest.fixture
def greedy_pool() -> Callable[..., tuple[list[int], list[torch.Tensor]]]:
    return greedy_with_pool


@torch.no_grad()
def hf_greedy(hf_model: Any, prompt: list[int], steps: int) -> list[int]:
    """transformers' own greedy generation (its cache), new tokens only."""
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.fixture
def hf_greedy_of() -> Callable[[Any, list[int], int], list[int]]:
    return hf_greedy


# LoRA adapters (models/lora): two that differ in every way the config can,
# ranks and alphas per module (patterns), rsLoRA, and which projections they adapt.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_ADAPTERS: dict[str, dict[str, Any]] = {
    "patterns": dict(
        r=8, lora_alpha=16, target_modules=LORA_TARGETS, rank_pattern={"v_proj": 4},
        alpha_pattern={"down_proj": 4},
    ),
    "rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
}  # fmt: skip


def _make_lora_adapter(hf_model: Any, path: Path, seed: int, **config: Any) -> Any:
    """Save a random PEFT adapter (B non-zero) of ``hf_model`` at ``path``;
    return PEFT's merged model (the oracle)."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():  # larger B, so each adapter moves the logits well past the tolerance
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0)
    peft_model.save_pretrained(path)
    return peft_model.merge_and_unload().eval()


@pytest.fixture(scope="session")
def make_lora_adapter() -> Callable[..., Any]:
    """``make(hf_model, path, seed, **LoraConfig fields)``: a PEFT adapter saved, its merged model."""
    return _make_lora_adapter


@pytest.fixture(scope="session")
def lora_adapters(
    checkpoints: dict[str, Checkpoint], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, tuple[Path, Any]]]:
    """family -> {adapter name: (directory, merged transformers model)}, for Llama and Qwen 3."""
    out = {}
    for family in ("llama", "qwen3"):
        hf = checkpoints[family].hf_model
        out[family] = {
            name: (path := tmp_path_factory.mktemp(f"lora-{family}-{name}"),
                   _make_lora_adapter(hf, path, seed, **config))
            for seed, (name, config) in enumerate(LORA_ADAPTERS.items())
        }  # fmt: skip
    return out
