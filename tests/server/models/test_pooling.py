"""Pooling models (``runner="pooling"``) against transformers: embeddings
pooled as the checkpoint's sentence-transformers files say (mean, CLS, last
token, normalized), a decoder LM converted to embed (last token, as
Qwen3-Embedding), ``*ForSequenceClassification`` scores, and the per-token
tasks (``token_embed``, ``token_classify``). Everything runs
through the engine's packed step with small chunks, so a prompt's rows are
pooled over several steps, beside other requests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaConfig, Qwen3Config

from paged_server.entrypoints.llm import LLM
from paged_server.pooling_params import PoolingParams

_SMALL: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256,
    initializer_range=0.1, pad_token_id=None, bos_token_id=None, eos_token_id=None,
)  # fmt: skip
_MODES = {"MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token",
          "LAST": "pooling_mode_lasttoken"}  # fmt: skip
# Two share a 12-token prefix (prefix-cache hits where the pooling allows them).
PROMPTS = [list(range(3, 40)), list(range(3, 15)) + [100, 101, 102], [7], list(range(200, 221))]


def _config(family: str, **extra: Any) -> Any:
    if family == "llama":
        return LlamaConfig(**_SMALL, **extra)
    return Qwen3Config(head_dim=32, **_SMALL, **extra)


def _save(model: Any, path: Path, tokenizer_json: Path) -> Path:
    model.save_pretrained(path)
    (path / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    return path


def _sentence_transformers(path: Path, mode: str, normalize: bool) -> None:
    """modules.json + 1_Pooling/config.json (+ 2_Normalize) as sentence-transformers saves them."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})  # fmt: skip
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    config = {"word_embedding_dimension": 64, **{key: key == _MODES[mode] for key in _MODES.values()}}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config))


def _llm(path: Path, **kw: Any) -> LLM:
    """Chunks of at most 8 tokens, two sequences a step, block size 4."""
    values = dict(device="cpu", dtype="float32", attention_backend="ref", max_model_len=64,
                  max_num_batched_tokens=8, max_batch_size=2, block_size=4, num_gpu_blocks=64,
                  enforce_eager=True)  # fmt: skip
    return LLM(str(path), **{**values, **kw})


@torch.no_grad()
def _hf_states(model: Any, prompt: list[int]) -> torch.Tensor:
    out = model(torch.tensor([prompt]), output_hidden_states=True)
    return out.hidden_states[-1][0]  # after the final norm, as AutoModel's last_hidden_state


def _pooled(states: torch.Tensor, mode: str) -> torch.Tensor:
    return {"MEAN": states.mean(0), "CLS": states[0], "LAST": states[-1]}[mode]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize(("mode", "normalize"), [("MEAN", True), ("CLS", True), ("LAST", False)])
def test_sentence_transformers_embeddings_equal_transformers(
    tmp_path: Path, tokenizer_json: Path, family: str, mode: str, normalize: bool
) -> None:
    torch.manual_seed(0)
    base = getattr(transformers, {"llama": "LlamaModel", "qwen3": "Qwen3Model"}[family])
    hf = base._from_config(_config(family), attn_implementation="eager").eval()
    path = _save(hf, tmp_path / "st", tokenizer_json)
    _sentence_transformers(path, mode, normalize)
    llm = _llm(path)  # *Model: a pooling runner by itself (runner="auto")
    outputs = llm.embed(PROMPTS)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        expected = _pooled(_hf_states(hf, prompt), mode)
        if normalize:
            expected = F.normalize(expected, dim=-1)
        got = torch.tensor(out.outputs.embedding)
        assert out.prompt_token_ids == prompt
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        assert float(F.cosine_similarity(got, expected, dim=0)) >= 0.9999


def test_causal_lm_converted_to_embed_pools_the_last_token_normalized(
    tmp_path: Path, tokenizer_json: Path
) -> None:
    """Qwen3-Embedding's way: a *ForCausalLM run with runner="pooling"; the
    prefix cache serves the shared prefix (last-token pooling allows it)."""
    torch.manual_seed(1)
    hf = transformers.Qwen3ForCausalLM._from_config(_config("qwen3"), attn_implementation="eager").eval()
    path = _save(hf, tmp_path / "qwen3-embedding", tokenizer_json)
    llm = _llm(path, runner="pooling")
    first = llm.embed(PROMPTS)
    again = llm.embed(PROMPTS[:2])  # now from the prefix cache where it can
    assert llm.engine.metrics()["prefix_cache_hits_total"] > 0
    for prompt, out in zip(PROMPTS + PROMPTS[:2], first + again, strict=True):
        expected = F.normalize(_hf_states(hf, prompt)[-1], dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-4, rtol=0)


def test_mean_pooling_skips_the_prefix_cache(tmp_path: Path, tokenizer_json: Path) -> None:
    """A prefix hit would leave the cached tokens' states uncomputed: a
    repeated prompt is recomputed and pools the same."""
    torch.manual_seed(2)
    hf = transformers.LlamaModel._from_config(_config("llama"), attn_implementation="eager").eval()
    path = _save(hf, tmp_path / "mean", tokenizer_json)
    _sentence_transformers(path, "MEAN", True)
    llm = _llm(path)
    first = llm.embed(PROMPTS[:1])[0].outputs.embedding
    second = llm.embed(PROMPTS[:1])[0].outputs.embedding
    assert llm.engine.metrics()["prefix_cache_hits_total"] == 0
    assert first == second


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sequence_classification_scores_equal_transformers(
    tmp_path: Path, tokenizer_json: Path, family: str
) -> None:
    """One label: vLLM's score is the sigmoid of transformers' logit; three
    labels: classify's probabilities are the softmax of its logits."""
    cls = getattr(transformers, {"llama": "LlamaForSequenceClassification",
                                 "qwen3": "Qwen3ForSequenceClassification"}[family])  # fmt: skip
    for num_labels in (1, 3):
        torch.manual_seed(num_labels)
        hf = cls._from_config(_config(family, num_labels=num_labels), attn_implementation="eager").eval()
        path = _save(hf, tmp_path / f"cls{num_labels}", tokenizer_json)
        llm = _llm(path)
        with torch.no_grad():
            logits = [hf(torch.tensor([p])).logits[0] for p in PROMPTS]
        if num_labels == 1:
            pairs = [("a query", "the first document"), ("a query", "another one, longer than that")]
            scores = llm.score("a query", [b for _, b in pairs])
            tok = llm.get_tokenizer()
            for (a, b), out in zip(pairs, scores, strict=True):
                with torch.no_grad():
                    logit = hf(torch.tensor([tok.encode_pair(a, b)])).logits[0, 0]
                assert out.outputs.score == pytest.approx(float(torch.sigmoid(logit)), abs=1e-4)
            got = [torch.tensor(o.outputs.probs) for o in llm.classify(PROMPTS)]
            torch.testing.assert_close(torch.stack(got), torch.sigmoid(torch.stack(logits)), atol=1e-4, rtol=0)
        else:
            got = [torch.tensor(o.outputs.probs) for o in llm.classify(PROMPTS)]
            expected = torch.softmax(torch.stack(logits), dim=-1)
            torch.testing.assert_close(torch.stack(got), expected, atol=1e-4, rtol=0)
            with pytest.raises(ValueError, match="num_labels == 1"):
                llm.score("a", "b")


def test_embedding_scores_are_cosines_and_dimensions_need_matryoshka(
    tmp_path: Path, tokenizer_json: Path
) -> None:
    torch.manual_seed(3)
    hf = transformers.LlamaModel._from_config(
        _config("llama", matryoshka_dimensions=[16, 32]), attn_implementation="eager"
    ).eval()
    path = _save(hf, tmp_path / "mrl", tokenizer_json)
    llm = _llm(path)
    text_1, text_2 = "the cat sat", ["on the mat", "in the hat"]
    scores = [o.outputs.score for o in llm.score(text_1, text_2)]
    tok = llm.get_tokenizer()
    with torch.no_grad():
        a = _hf_states(hf, tok.encode(text_1))[-1]
        expected = [float(F.cosine_similarity(a, _hf_states(hf, tok.encode(t))[-1], dim=0)) for t in text_2]
    assert scores == pytest.approx(expected, abs=1e-4)
    short = llm.embed(PROMPTS[:1], PoolingParams(dimensions=16))[0].outputs.embedding
    expected_short = F.normalize(_hf_states(hf, PROMPTS[0])[-1][:16], dim=-1)
    torch.testing.assert_close(torch.tensor(short), expected_short, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match=r"only supports \[16, 32\] matryoshka dimensions"):
        llm.embed(PROMPTS[:1], PoolingParams(dimensions=8))


def test_token_embed_is_every_prompt_tokens_normalized_state(tmp_path: Path, tokenizer_json: Path) -> None:
    """``LLM.encode(pooling_task="token_embed")`` on a converted LM (last-token
    pooling, which the prefix cache serves): a row per prompt token, each
    transformers' final-norm state normalized, over chunks of 8 and when the
    same prompts come again (they skip the cache, so every row is computed)."""
    torch.manual_seed(6)
    hf = transformers.LlamaForCausalLM._from_config(_config("llama"), attn_implementation="eager").eval()
    path = _save(hf, tmp_path / "lm", tokenizer_json)
    llm = _llm(path, runner="pooling")
    for _ in range(2):
        outputs = llm.encode(PROMPTS, pooling_task="token_embed")
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            expected = F.normalize(_hf_states(hf, prompt), dim=-1)
            got = out.outputs.data
            assert got.shape == expected.shape and out.prompt_token_ids == prompt
            assert float(F.cosine_similarity(got, expected, dim=-1).min()) >= 0.9999
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert llm.engine.metrics()["prefix_cache_hits_total"] == 0
    llm.embed(PROMPTS[:1])  # last-token pooling still reads the cache
    assert llm.engine.metrics()["prefix_cache_hits_total"] > 0
    with pytest.raises(ValueError, match="task: token_classify is not supported"):
        llm.encode(PROMPTS[:1], pooling_task="token_classify")
    with pytest.raises(ValueError, match="task: must be one of"):
        llm.encode(PROMPTS[:1], pooling_task="token_everything")


def test_token_classify_is_every_prompt_tokens_probabilities(tmp_path: Path, tokenizer_json: Path) -> None:
    """A classifier's ``token_classify``: the softmax of its score head on each token's state."""
    torch.manual_seed(7)
    hf = transformers.LlamaForSequenceClassification._from_config(
        _config("llama", num_labels=3), attn_implementation="eager"
    ).eval()
    path = _save(hf, tmp_path / "cls", tokenizer_json)
    llm = _llm(path)
    for prompt, out in zip(PROMPTS, llm.encode(PROMPTS, pooling_task="token_classify"), strict=True):
        with torch.no_grad():
            expected = torch.softmax(hf.score(hf.model(torch.tensor([prompt])).last_hidden_state[0]), -1)
        torch.testing.assert_close(out.outputs.data, expected, atol=1e-4, rtol=0)


def test_refusals(tmp_path: Path, tokenizer_json: Path) -> None:
    torch.manual_seed(4)
    hf = transformers.LlamaForCausalLM._from_config(_config("llama"), attn_implementation="eager").eval()
    path = _save(hf, tmp_path / "lm", tokenizer_json)
    generator = _llm(path)
    with pytest.raises(ValueError, match="need --runner pooling"):
        generator.embed(["hello"])
    embedder = _llm(path, task="embed")  # vLLM's older spelling
    with pytest.raises(ValueError, match='Model ".*" does not support matryoshka representation'):
        embedder.embed(["hello"], PoolingParams(dimensions=8))
    assert "does not generate" in (embedder.generate(["hello"])[0].outputs[0].error or "")
    with pytest.raises(ValueError, match="task: classify is not supported"):
        embedder.classify(["hello"])
    with pytest.raises(ValueError, match="max_model_len"):
        embedder.embed([list(range(100))])
    seq_cls = transformers.LlamaForSequenceClassification._from_config(_config("llama", num_labels=1))
    cls_path = _save(seq_cls, tmp_path / "cls", tokenizer_json)
    with pytest.raises(ValueError, match="--runner pooling"):
        _llm(cls_path, runner="generate")


def test_pooler_config_overrides_the_checkpoints_pooling(tmp_path: Path, tokenizer_json: Path) -> None:
    """vLLM's --pooler-config: mean pooling, not normalized, on a converted LM;
    a key it does not know is refused by name."""
    torch.manual_seed(5)
    hf = transformers.LlamaForCausalLM._from_config(_config("llama"), attn_implementation="eager").eval()
    path = _save(hf, tmp_path / "lm", tokenizer_json)
    llm = _llm(path, runner="pooling", pooler_config={"pooling_type": "mean", "normalize": False})
    for prompt, out in zip(PROMPTS, llm.embed(PROMPTS), strict=True):
        expected = _hf_states(hf, prompt).mean(0)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="'step_tag_id' is not supported"):
        _llm(path, runner="pooling", pooler_config={"step_tag_id": 3})
