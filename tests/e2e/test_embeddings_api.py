"""The pooling API against a real server: the ``openai`` client's
``embeddings.create`` (float and base64) on a tiny sentence-transformers
checkpoint (mean pooling, normalized), batches and token ids, vLLM's
``/pooling`` (per-token too), ``/score`` and ``/rerank``, a cross-encoder's ``/classify``
and ``/rerank``, and the errors in OpenAI's shape. Transformers is the oracle."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
import transformers

from paged_server.default_model.tokenizer_builder import build_tokenizer
from paged_server.tokenizer import Tokenizer

from .conftest import MODEL, start_server

_SMALL: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256,
    initializer_range=0.1, pad_token_id=None, bos_token_id=None, eos_token_id=None,
)  # fmt: skip


def _checkpoint(path: Path, model: Any) -> Path:
    model.save_pretrained(path)
    build_tokenizer(512).save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Tokenizer]]:
    """(server, transformers model, tokenizer): a LlamaModel saved with
    sentence-transformers' mean pooling and Normalize modules."""
    torch.manual_seed(0)
    hf = transformers.LlamaModel._from_config(transformers.LlamaConfig(**_SMALL),
                                              attn_implementation="eager").eval()  # fmt: skip
    path = _checkpoint(tmp_path_factory.mktemp("embedder"), hf)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))  # fmt: skip
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    server = start_server(model=str(path), max_model_len=64)
    try:
        yield server, hf, Tokenizer.from_dir(path)
    finally:
        server.stop()


def _expected(hf: Any, ids: list[int]) -> list[float]:
    with torch.no_grad():
        states = hf(torch.tensor([ids])).last_hidden_state[0]
    return F.normalize(states.mean(0), dim=-1).tolist()


def _client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_openai_client_embeddings_float_and_base64(embedder: Any) -> None:
    server, hf, tok = embedder
    client = _client(server)
    texts = ["the quick brown fox", "jumps over the lazy dog, twice"]
    expected = [_expected(hf, tok.encode(t)) for t in texts]
    # Left unset, the client asks for base64 and decodes it itself; asked
    # for, base64 comes back as OpenAI's little-endian float32 bytes.
    for encoding in ("float", None, "base64"):
        kwargs = {"encoding_format": encoding} if encoding else {}
        response = client.embeddings.create(model=MODEL, input=texts, **kwargs)
        assert [d.index for d in response.data] == [0, 1]
        for got, want in zip(response.data, expected, strict=True):
            vector = got.embedding
            if encoding == "base64":
                assert isinstance(vector, str)
                vector = np.frombuffer(base64.b64decode(vector), dtype="<f4").tolist()
            assert vector == pytest.approx(want, abs=1e-4)
        n = sum(len(tok.encode(t)) for t in texts)
        assert response.usage.prompt_tokens == response.usage.total_tokens == n
    one = client.embeddings.create(model=MODEL, input=texts[0], user="someone")
    assert one.data[0].embedding == pytest.approx(expected[0], abs=1e-4)


def test_token_id_inputs_and_batches(embedder: Any) -> None:
    server, hf, _ = embedder
    batch = [[5, 6, 7, 8], [100, 200, 300], list(range(20, 60))]
    body = httpx.post(f"{server.url}/v1/embeddings", json={"input": batch, "model": MODEL}).json()
    assert [d["object"] for d in body["data"]] == ["embedding"] * 3
    for d, ids in zip(body["data"], batch, strict=True):
        assert d["embedding"] == pytest.approx(_expected(hf, ids), abs=1e-4)
    one = httpx.post(f"{server.url}/v1/embeddings", json={"input": batch[0]}).json()
    assert len(one["data"]) == 1 and one["usage"]["prompt_tokens"] == 4
    pooled = httpx.post(f"{server.url}/pooling", json={"input": batch[1]}).json()
    assert pooled["data"][0]["data"] == pytest.approx(_expected(hf, batch[1]), abs=1e-4)


def test_pooling_token_embed_is_a_vector_per_token(embedder: Any) -> None:
    """vLLM's ``/pooling`` with ``"task": "token_embed"``: each input's
    ``data`` is a list of per-token vectors (transformers' states, each
    normalized); a task the model does not run is vLLM's 400."""
    server, hf, _ = embedder
    batch = [[5, 6, 7, 8], list(range(20, 60))]
    body = httpx.post(f"{server.url}/pooling", json={"input": batch, "task": "token_embed"}).json()
    for d, ids in zip(body["data"], batch, strict=True):
        with torch.no_grad():
            states = F.normalize(hf(torch.tensor([ids])).last_hidden_state[0], dim=-1)
        got = torch.tensor(d["data"])
        assert got.shape == states.shape and d["object"] == "pooling"
        assert float(F.cosine_similarity(got, states, dim=-1).min()) >= 0.9999
    assert body["usage"]["prompt_tokens"] == 44
    for task in ("token_classify", "tokens"):
        response = httpx.post(f"{server.url}/pooling", json={"input": "hi", "task": task})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["message"].startswith(f"Task {task} is not supported") and error["param"] == "task"


def test_score_and_rerank_by_cosine(embedder: Any) -> None:
    server, hf, tok = embedder
    query, docs = "a cat", ["a small cat", "the stock market", "cats and dogs"]
    vectors = {t: torch.tensor(_expected(hf, tok.encode(t))) for t in [query, *docs]}
    cosines = [float(vectors[query] @ vectors[d]) for d in docs]
    score = httpx.post(f"{server.url}/score", json={"text_1": query, "text_2": docs}).json()
    assert [d["score"] for d in score["data"]] == pytest.approx(cosines, abs=1e-4)
    ranked = httpx.post(f"{server.url}/v1/rerank",
                        json={"query": query, "documents": docs, "top_n": 2}).json()  # fmt: skip
    best = sorted(range(3), key=lambda i: -cosines[i])[:2]
    assert [r["index"] for r in ranked["results"]] == best
    assert ranked["results"][0]["document"] == {"text": docs[best[0]]}


def test_errors_in_openai_shape(embedder: Any) -> None:
    server, _, _ = embedder
    client = _client(server)
    for bad in ([], [[]]):
        response = httpx.post(f"{server.url}/v1/embeddings", json={"input": bad})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "input" and error["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.embeddings.create(model=MODEL, input=[list(range(1, 100))])
    assert "max_model_len" in too_long.value.message and too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="does not support matryoshka representation"):
        client.embeddings.create(model=MODEL, input="hello", dimensions=8)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="another-model", input="hello")
    chat = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert chat.status_code == 400 and "does not generate" in chat.json()["error"]["message"]


def test_a_generation_model_answers_with_vllms_error(server: Any) -> None:
    """The session's embedded generation model: 400 with vLLM's message, not 404."""
    for path, body in (("/v1/embeddings", {"input": "hi"}), ("/pooling", {"input": "hi"}),
                       ("/score", {"text_1": "a", "text_2": "b"}),
                       ("/rerank", {"query": "a", "documents": ["b"]})):  # fmt: skip
        response = httpx.post(f"{server.url}{path}", json=body)
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["message"].startswith("The model does not support")


def test_cross_encoder_classify_and_rerank(tmp_path: Path) -> None:
    torch.manual_seed(1)
    config = transformers.Qwen3Config(head_dim=32, num_labels=1, **_SMALL)
    hf = transformers.Qwen3ForSequenceClassification._from_config(config, attn_implementation="eager").eval()
    path = _checkpoint(tmp_path / "reranker", hf)
    server = start_server(model=str(path), max_model_len=64)
    try:
        tok = Tokenizer.from_dir(path)
        query, docs = "where is the cat", ["on the mat", "in the bank", "the cat is here"]
        with torch.no_grad():
            expected = [float(torch.sigmoid(hf(torch.tensor([tok.encode_pair(query, d)])).logits[0, 0]))
                        for d in docs]  # fmt: skip
        ranked = httpx.post(f"{server.url}/rerank", json={"query": query, "documents": docs}).json()
        assert {r["index"]: r["relevance_score"] for r in ranked["results"]} == pytest.approx(
            dict(enumerate(expected)), abs=1e-4
        )
        returned = [r["relevance_score"] for r in ranked["results"]]
        assert returned == sorted(returned, reverse=True) and len(returned) == 3
        probs = httpx.post(f"{server.url}/classify", json={"input": docs[0]}).json()["data"][0]
        assert probs["num_classes"] == 1 and probs["label"] == "LABEL_0"
        embed = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hi"})
        assert embed.status_code == 400
        assert embed.json()["error"]["message"] == "The model does not support Embeddings API"
    finally:
        server.stop()


@pytest.mark.slow
def test_data_parallel_replicas_embed(embedder: Any, tmp_path: Path) -> None:
    """--data-parallel-size 2: each replica pools, and the answers are the
    one-engine server's."""
    server, _, _ = embedder
    path = Path(server.engine.config.model)
    batch = [[5, 6, 7, 8], [100, 200, 300], list(range(20, 60)), [9, 9, 9]]
    want = httpx.post(f"{server.url}/v1/embeddings", json={"input": batch}).json()["data"]
    dp = start_server(model=str(path), max_model_len=64, data_parallel_size=2, enforce_eager=True)
    try:
        got = httpx.post(f"{dp.url}/v1/embeddings", json={"input": batch}, timeout=120).json()["data"]
        for a, b in zip(got, want, strict=True):
            assert a["embedding"] == pytest.approx(b["embedding"], abs=1e-5)
        assert sum(m > 0 for m in _requests_per_replica(dp)) == 2
    finally:
        dp.stop()


def _requests_per_replica(server: Any) -> list[float]:
    return [r.metrics.get("prompt_tokens_total", 0.0) for r in server.engine._replicas]
