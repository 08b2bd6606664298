"""The start-up warm-up lists exactly the Triton kernel variants a server
launches: every launch of real engine runs (prefill, decode, chunked
prefill, prefix hits, n > 1 forks with copy-on-write) is recorded with the
key Triton's JIT would compile it under on a GPU, and the set of keys must
equal ``paged_triton.warmup.kernel_variants`` for the engine's layout.
Tiny Llama, Qwen3 and Gemma 3 (sliding window and soft-cap) checkpoints,
float32 and float16 models, model-dtype, int8 and fp8 caches. On CPU the
kernels run in Triton's interpreter; on a GPU the same test checks the
CUDA list (split decode and its merge included)."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen3Config, Qwen3ForCausalLM

import paged_triton
from paged_server.config import EngineConfig
from paged_server.default_model.tokenizer_builder import build_tokenizer
from paged_server.engine.core.llm_engine import LLMEngine
from paged_server.engine.worker.kernel_warmup import attention_layout
from paged_server.models import load_model
from paged_server.sampling_params import SamplingParams

if not paged_triton.is_available():
    pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from paged_triton.launch import Launch  # noqa: E402  (after the interpreter check)
from paged_triton.warmup import LayerAttention, kernel_variants, variant_key  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB = 512
SMALL = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
    pad_token_id=None,
)  # fmt: skip


def _hf_model(family: str):
    torch.manual_seed(0)
    if family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=2, head_dim=32, **SMALL))
    config = Gemma3TextConfig(
        num_hidden_layers=3, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attn_logit_softcapping=20.0, **SMALL,
    )  # fmt: skip
    return Gemma3ForCausalLM(config)


@pytest.fixture(scope="module")
def checkpoint_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Llama (the engine tests' checkpoint), Qwen3 and Gemma 3 directories."""
    dirs = {"llama": tiny_model_dir}
    for family in ("qwen3", "gemma3"):
        path = tmp_path_factory.mktemp(f"warmup-{family}")
        _hf_model(family).save_pretrained(path)
        build_tokenizer(VOCAB).save(str(path / "tokenizer.json"))
        dirs[family] = path
    return dirs


class LaunchRecorder:
    """Every kernel launch's variant key (a launch replayed for the next
    layers of a step counts with its own tensors)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.keys: dict[tuple, str] = {}
        run = Launch.run

        def recording(launch: Launch, args=None) -> None:
            planned = launch if args is None else dataclasses.replace(launch, args=tuple(args))
            self.keys.setdefault(variant_key(planned), describe(planned))
            run(launch, args)

        monkeypatch.setattr(Launch, "run", recording)


def describe(launch: Launch) -> str:
    flags = {k: v for k, v in launch.constexprs.items() if k.startswith(("USE_", "KV_QUANT"))}
    return f"{launch.kernel.__name__} {flags}"


def workload(prompt_of) -> tuple[list, list]:
    """First wave: a long prompt (chunked), short ones, an n=3 fork whose
    prompt ends mid-block (copy-on-write). Second wave: the long prompt's
    prefix again (prefix-cache hits), mixed with decodes of the first."""
    system = prompt_of(20, 7)
    fork = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = [("long", system + prompt_of(10, 1), greedy), ("fork", prompt_of(13, 2), fork)]
    first += [(f"s{i}", prompt_of(3 + i, 10 + i), greedy) for i in range(2)]
    second = [(f"hit{i}", system + prompt_of(2 + i, 20 + i), greedy) for i in range(2)]
    return first, second


CASES = [
    ("llama", torch.float32, "auto", False),
    ("qwen3", torch.float16, "fp8_e5m2", False),
    ("gemma3", torch.float32, "int8", False),
    ("llama", torch.float16, "int8", True),  # calculate_kv_scales: the HEAD_SCALES variants
]


@pytest.mark.parametrize(
    "family,dtype,kv_cache_dtype,calculate_kv_scales", CASES,
    ids=[f"{f}-{str(d)[6:]}-kv_{k}" + ("-calc" if c else "") for f, d, k, c in CASES],
)  # fmt: skip
def test_warmup_lists_exactly_what_serving_launches(
    checkpoint_dirs, family, dtype, kv_cache_dtype, calculate_kv_scales, prompt_of, monkeypatch
) -> None:
    loaded = load_model(checkpoint_dirs[family], dtype, DEVICE)
    config = EngineConfig(
        max_batch_size=4, max_model_len=128, max_num_batched_tokens=16, block_size=4,
        device=DEVICE.type, attention_backend="triton", kv_cache_dtype=kv_cache_dtype,
        calculate_kv_scales=calculate_kv_scales,
        enforce_eager=True,  # on a GPU: decode launches run eagerly, where they can be recorded
    )  # fmt: skip
    engine = LLMEngine(config, loaded)
    recorder = LaunchRecorder(monkeypatch)
    first, second = workload(prompt_of)
    for wave in (first, second):
        for request in wave:
            engine.add_request(*request)
        while engine.has_unfinished():
            engine.step()
        assert engine.audit() == []
    assert engine.metrics()["prefix_cache_hits_total"] > 0

    layout = attention_layout(loaded.model, loaded.dtype, engine.worker.tensors, config.max_model_len)
    listed = {v.key(): v.name for v in kernel_variants(layout, DEVICE)}
    launched = recorder.keys
    never_listed = [launched[k] for k in launched.keys() - listed.keys()]
    never_launched = [listed[k] for k in listed.keys() - launched.keys()]
    assert not never_listed, f"launched but not warmed up: {never_listed}"
    assert not never_launched, f"warmed up but never launched: {never_launched}"

    if family == "gemma3":  # the check has teeth: a list without the soft-cap misses launches
        capless = dataclasses.replace(
            layout, layers=tuple(LayerAttention(w.sliding_window) for w in layout.layers)
        )
        keys = {v.key() for v in kernel_variants(capless, DEVICE)}
        assert launched.keys() - keys


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_start_compiles_every_variant_and_says_so(checkpoint_dirs, caplog, monkeypatch) -> None:
    monkeypatch.setenv("PAGED_ALLOW_LONG_MAX_MODEL_LEN", "1")  # 2048 on a 256-position model
    loaded = load_model(checkpoint_dirs["gemma3"], torch.bfloat16, "cuda")
    config = EngineConfig(max_batch_size=4, max_model_len=2048, device="cuda",
                          attention_backend="triton")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="paged_server.engine.worker.kernel_warmup"):
        engine = LLMEngine(config, loaded)
    lines = [r.getMessage() for r in caplog.records if "Triton kernel variants" in r.getMessage()]
    assert len(lines) == 1 and re.fullmatch(r"compiled \d+ Triton kernel variants in \d+\.\d s", lines[0])
    layout = attention_layout(loaded.model, loaded.dtype, engine.worker.tensors, config.max_model_len)
    names = [v.name for v in kernel_variants(layout, DEVICE)]
    assert int(lines[0].split()[1]) == len(names)
    # 2048-token contexts split on a GPU (Gemma 3's variants carry "softcap")
    assert any(name.startswith("decode_merge") for name in names)
