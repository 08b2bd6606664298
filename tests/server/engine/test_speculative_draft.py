"""Speculative decoding with a draft model (``{"model": DIR, ...}``): every
answer stays the target model's. Greedy output is identical token for token
with and without the draft, whether it agrees with the target only
sometimes (a perturbed copy: drafts rejected and kept) or always (the target
itself: every draft kept); a seeded request gives the same text whatever
its neighbours; the draft engine holds no KV block once the target is done;
a draft with another tokenizer is refused in one line."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from paged_server.default_model.tokenizer_builder import build_tokenizer
from paged_server.sampling_params import SamplingParams
from paged_server.speculative_config import SpeculativeConfig

K = 3


def _spec(model: Path, **extra) -> dict:
    # drafting for every sequence, whatever the batch (a CPU's default drafts at one stream only)
    return {"model": str(model), "num_speculative_tokens": K, "min_acceptance": 0, "disable_by_batch_size": 64, **extra}


@pytest.fixture(scope="module")
def perturbed_dir(cycling_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cycling model with its MLPs' part in the residual stream scaled
    up: it mostly agrees with the cycling model, not always."""
    path = tmp_path_factory.mktemp("perturbed")
    shutil.copytree(cycling_model_dir, path, dirs_exist_ok=True)
    weights = load_file(path / "model.safetensors")
    for name in weights:
        if name.endswith("mlp.down_proj.weight"):
            weights[name] = weights[name] * 3.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _other_tokenizer(path: Path, vocab: int, eos: int, context: int = 256) -> Path:
    build_tokenizer(vocab).save(str(path / "tokenizer.json"))
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=context,
        eos_token_id=eos, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _requests(prompt_of, greedy) -> list:
    return [(f"g{i}", prompt_of(5 + 3 * i, i), greedy(16, logprobs=1)) for i in range(4)] + [
        ("long", prompt_of(40, 9), greedy(12)),  # chunked: the budget is 32
        ("stop", prompt_of(6, 3), greedy(20, stop_token_ids=[7])),
    ]


def test_config_takes_a_draft_model() -> None:
    spec = SpeculativeConfig.parse({"model": "/d", "num_speculative_tokens": 2})
    assert (spec.method, spec.model) == ("draft_model", "/d")  # vLLM: a model that is no head drafts
    named = SpeculativeConfig.parse({"method": "draft_model", "model": "/d", "num_speculative_tokens": 2})
    assert named.method == "draft_model"


@pytest.mark.parametrize("draft", ["perturbed", "itself"])
def test_greedy_output_is_identical_with_and_without_the_draft_model(
    make_cycling, run_engine, prompt_of, greedy, perturbed_dir, cycling_model_dir, draft, caplog
) -> None:
    config = dict(max_num_batched_tokens=32, num_gpu_blocks=40)
    requests = _requests(prompt_of, greedy)
    ref = run_engine(make_cycling(**config), requests)
    model = perturbed_dir if draft == "perturbed" else cycling_model_dir
    with caplog.at_level(logging.INFO):
        engine = make_cycling(speculative_config=_spec(model), **config)
    assert any("draft model" in r.message and "blocks of 4" in r.message for r in caplog.records)
    run = run_engine(engine, requests)
    for key, choice in ref.choices.items():
        got = run.choices[key]
        assert (got.token_ids, got.text, got.finish_reason) == (
            choice.token_ids, choice.text, choice.finish_reason
        ), key
        assert got.logprobs == pytest.approx(choice.logprobs, abs=1e-4), key
    m = engine.metrics()
    drafted, kept = m["spec_decode_num_draft_tokens_total"], m["spec_decode_num_accepted_tokens_total"]
    if draft == "itself":
        assert drafted > 0 and kept == drafted  # the target's own greedy tokens
        assert run.steps < ref.steps
    else:
        assert 0 < kept < drafted  # some drafts kept, some rejected
    assert engine.audit() == [] and m["kv_cache_usage_perc"] == 0.0
    draft_engine = engine._proposer.engine
    assert draft_engine.audit() == [] and draft_engine.metrics()["kv_cache_usage_perc"] == 0.0
    assert draft_engine.metrics()["prefix_cache_hits_total"] > 0  # each step prefills only what is new
    engine.shutdown()


def test_a_seeded_request_gives_the_same_text_whatever_its_neighbours(
    make_cycling, run_engine, prompt_of, greedy, perturbed_dir
) -> None:
    seeded = SamplingParams(max_tokens=20, temperature=0.8, seed=11, ignore_eos=True)
    prompt = prompt_of(8, 5)
    alone = run_engine(make_cycling(speculative_config=_spec(perturbed_dir)), [("s", prompt, seeded)])
    engine = make_cycling(speculative_config=_spec(perturbed_dir))
    crowd = run_engine(
        engine, [("s", prompt, seeded)] + [(f"n{i}", prompt_of(7, i), greedy(20)) for i in range(3)]
    )
    assert crowd.tokens("s") == alone.tokens("s")
    assert engine.metrics()["spec_decode_num_draft_tokens_total"] > 0


@pytest.mark.parametrize(("vocab", "eos", "message"), [(256, 0, "vocab_size 256 against 512"), (512, 1, r"EOS ids \[1\] against \[0\]")])
def test_a_draft_with_another_tokenizer_is_refused(make_cycling, tmp_path, vocab, eos, message) -> None:
    draft = _other_tokenizer(tmp_path, vocab, eos)
    with pytest.raises(ValueError, match=message) as err:
        make_cycling(speculative_config=_spec(draft))
    text = str(err.value)
    assert "\n" not in text and str(draft) in text and "the target model" in text


def test_a_draft_with_a_shorter_context_needs_its_own_max_model_len(make_cycling, tmp_path) -> None:
    draft = _other_tokenizer(tmp_path, 512, 0, context=64)  # the target runs 128 tokens
    with pytest.raises(ValueError, match=f'draft model {draft}: max_model_len.*set the draft\'s with "max_model_len"'):
        make_cycling(speculative_config=_spec(draft))
    engine = make_cycling(speculative_config=_spec(draft, max_model_len=64))
    assert engine._proposer.max_model_len == 64  # histories past it get no draft
    engine.shutdown()


def test_drafts_are_the_draft_models_own_greedy_tokens(
    make_cycling, run_engine, prompt_of, greedy, tiny_model_dir
) -> None:
    """The proposer runs the draft's passes itself (no scheduler): its drafts
    equal what an engine serving the draft model generates greedily for
    each history: a new one (long ones caught up in chunks of the 8-token
    budget), one grown by a kept draft and a token that is none (its KV
    kept to there, the rest recomputed), and a new sequence over a known
    history (prefix hits). The draft is a random tiny model, whose every
    token depends on the cache."""
    from paged_server.config import EngineConfig
    from paged_server.engine.core.llm_engine import LLMEngine

    engine = make_cycling(speculative_config=_spec(tiny_model_dir), max_num_batched_tokens=8)
    proposer = engine._proposer
    plain = LLMEngine(EngineConfig(
        model=str(tiny_model_dir), max_batch_size=8, max_model_len=128, block_size=4, device="cpu",
        attention_backend="ref",
    ))  # fmt: skip
    histories = [prompt_of(n, n) for n in (3, 10, 26, 9)]
    limits = [K, 2, K, 0]  # at most K drafts; a limit of 0 drafts nothing
    keys = [0, 1, 2, 3]
    drafts: list[list[int]] = []
    for round_ in range(3):
        if round_ == 1:  # as after a verify step: a kept draft, then the target's own token
            histories = [h + d[:1] + [(d[1] + 1) % 500 if len(d) > 1 else 7] for h, d in zip(histories, drafts, strict=True)]
        if round_ == 2:  # new sequences with the same histories, all k drafts (one call for the passes)
            keys, limits = [key + 10 for key in keys], [K] * len(histories)
        drafts = proposer.propose_all(keys, histories, limits)
        for history, limit, draft in zip(histories, limits, drafts, strict=True):
            want = run_engine(plain, [("d", history, greedy(limit))]).tokens("d") if limit else []
            assert draft == want, (round_, len(history), limit)
    draft_engine = proposer.engine
    assert draft_engine.metrics()["prefix_cache_hits_total"] > 0  # the new sequences'
    proposer.retain([10, 11])  # two sequences still run: their draft KV stays
    assert draft_engine.metrics()["kv_cache_usage_perc"] > 0.0
    proposer.retain([])  # the target runs nothing: no draft KV is held
    assert draft_engine.audit() == [] and draft_engine.metrics()["kv_cache_usage_perc"] == 0.0
    plain.shutdown()
    engine.shutdown()


def test_a_cpu_draft_model_drafts_at_one_stream_unless_told_otherwise(make_cycling, tiny_model_dir) -> None:
    from paged_server.engine.speculative.draft_model import (
        CPU_DISABLE_BY_BATCH_SIZE,
        with_cpu_default,
    )

    spec = SpeculativeConfig.parse({"model": str(tiny_model_dir), "num_speculative_tokens": K})
    assert with_cpu_default(spec, "cpu").disable_by_batch_size == CPU_DISABLE_BY_BATCH_SIZE == 2
    assert with_cpu_default(spec, "cuda").disable_by_batch_size is None
    told = SpeculativeConfig.parse({**_spec(tiny_model_dir), "disable_by_batch_size": 8})
    assert with_cpu_default(told, "cpu").disable_by_batch_size == 8
    ngram = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": K})
    assert with_cpu_default(ngram, "cpu").disable_by_batch_size is None
    engine = make_cycling(speculative_config={"model": str(tiny_model_dir), "num_speculative_tokens": K})
    assert engine._spec.speculates(1) and not engine._spec.speculates(2)
    engine.shutdown()
