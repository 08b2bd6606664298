"""The pooling API on a pooling model (``--runner pooling``):
``/v1/embeddings``, ``/pooling``, ``/classify``, ``/score`` and ``/rerank``.

Each input is one engine request with ``PoolingParams`` (prompt only, see
``engine/request/pooling.py``); the bodies are vLLM's. A generation model answers
each of them with vLLM's 400 ("The model does not support Embeddings API").
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import numpy as np
from fastapi import Request

from paged_server.engine.request.pooling import check_dimensions, pooling_tasks
from paged_server.entrypoints.openai.async_engine import AsyncEngine
from paged_server.entrypoints.openai.errors import APIError
from paged_server.entrypoints.openai.generation import Generation, GenerationEnded
from paged_server.entrypoints.openai.pooling_protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    normalize_inputs,
)
from paged_server.entrypoints.scoring import check_scoring, cosine, score_pairs
from paged_server.models.pooler import PoolerConfig
from paged_server.pooling_params import PoolingParams


class OpenAIPooling:
    """The pooling endpoints over ``engine``; ``pooler``: the model's
    (None: a generation model, which refuses them all)."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, pooler: PoolerConfig | None,
                 serving: Any) -> None:  # fmt: skip
        self.engine = engine
        self.tokenizer = tokenizer
        self.pooler = pooler
        self.serving = serving  # the model name and check_model

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> dict[str, Any]:
        pooler = self._pooler(body.model, "Embeddings API", "embed")
        check = body.dimensions
        try:
            check_dimensions(pooler, check, self.serving.model_name)
        except ValueError as exc:
            raise APIError(400, str(exc).removeprefix("dimensions: "), param="dimensions") from None
        params = PoolingParams("embed", body.dimensions, body.normalize, None, body.truncate_prompt_tokens)
        prompts, vectors = await self._run(body, normalize_inputs(body.input), params, request)
        data = [{"index": i, "object": "embedding", "embedding": _encode(v, body.encoding_format)}
                for i, v in enumerate(vectors)]  # fmt: skip
        return self._body("embd", data, prompts)

    async def pooling(self, body: PoolingRequest, request: Request) -> dict[str, Any]:
        pooler = self._pooler(body.model, "Pooling API", None)
        task = body.task or "encode"
        if task not in (tasks := pooling_tasks(pooler)):
            raise APIError(400, f"Task {task} is not supported, it must be one of {list(tasks)}.",
                           param="task")  # fmt: skip
        params = PoolingParams(task, None, body.normalize, None, body.truncate_prompt_tokens)
        prompts, vectors = await self._run(body, normalize_inputs(body.input), params, request)
        data = [{"index": i, "object": "pooling", "data": _encode(v, body.encoding_format)}
                for i, v in enumerate(vectors)]  # fmt: skip
        return self._body("pool", data, prompts)

    async def classify(self, body: ClassificationRequest, request: Request) -> dict[str, Any]:
        pooler = self._pooler(body.model, "Classification API", "classify")
        params = PoolingParams("classify", truncate_prompt_tokens=body.truncate_prompt_tokens)
        prompts, vectors = await self._run(body, normalize_inputs(body.input), params, request)
        data = []
        for i, v in enumerate(vectors):
            best = int(v.argmax())
            label = pooler.labels[best] if best < len(pooler.labels) else f"LABEL_{best}"
            data.append({"index": i, "label": label, "probs": v.tolist(), "num_classes": len(v)})
        return self._body("classify", data, prompts)

    async def score(self, body: ScoreRequest, request: Request) -> dict[str, Any]:
        self._pooler(body.model, "Score API", None)
        scores, prompts = await self._scores(body, body.text_1, body.text_2, "text_1", request)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return self._body("score", data, prompts)

    async def rerank(self, body: RerankRequest, request: Request) -> dict[str, Any]:
        self._pooler(body.model, "Rerank API", None)
        if not body.documents:
            raise APIError(400, "documents: must not be empty", param="documents")
        scores, prompts = await self._scores(body, body.query, body.documents, "query", request)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if body.top_n:
            order = order[: body.top_n]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": body.documents[i]}} if body.return_documents else {})}
                   for i in order]  # fmt: skip
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": self.serving.model_name,
                "usage": {"total_tokens": sum(prompts)}, "results": results}  # fmt: skip

    # ------------------------------------------------------------ helpers
    def _pooler(self, model: str | None, api: str, head: str | None) -> PoolerConfig:
        """The model's pooler, or vLLM's 400 when it cannot serve ``api``."""
        if self.serving.check_model(model) is not None:
            raise APIError(400, f"model: {model!r} is a LoRA adapter; adapters serve generation "
                           "here, send the base model's name", param="model")  # fmt: skip
        if self.pooler is None or (head is not None and self.pooler.head != head):
            raise APIError(400, f"The model does not support {api}", code="unsupported_api")
        return self.pooler

    async def _scores(self, body: Any, text_1: Any, text_2: Any, param: str,
                      request: Request) -> tuple[list[float], list[int]]:  # fmt: skip
        """Each pair's score and the prompt token counts it took."""
        pooler = self.pooler
        assert pooler is not None
        try:
            pairs = score_pairs(text_1, text_2)
            check_scoring(pooler)
        except ValueError as exc:
            field, _, message = str(exc).partition(": ")
            raise APIError(400, str(exc), param=param if field.startswith("text") else field) from None
        params = PoolingParams("score", truncate_prompt_tokens=body.truncate_prompt_tokens)
        if pooler.head == "classify":
            prompts: list[str | list[int]] = [self.tokenizer.encode_pair(a, b) for a, b in pairs]
            counts, vectors = await self._run(body, prompts, params, request)
            return [float(v[0]) for v in vectors], counts
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        counts, vectors = await self._run(body, list(texts), params, request)
        by_text = dict(zip(texts, vectors, strict=True))
        return [cosine(by_text[a], by_text[b]) for a, b in pairs], counts

    async def _run(self, body: Any, inputs: list[str | list[int]], params: PoolingParams,
                   request: Request) -> tuple[list[int], list[Any]]:  # fmt: skip
        """Every input through the engine: prompt token counts and pooled tensors, in order."""
        prompts = [self.tokenizer.encode(p, add_special_tokens=body.add_special_tokens)
                   if isinstance(p, str) else p for p in inputs]  # fmt: skip
        gen = Generation(self.engine, f"pool-{uuid.uuid4().hex}", 1, time.monotonic())
        await gen.submit(prompts, params, prompt_param="input")
        vectors: list[Any] = [None] * len(prompts)
        try:
            async for i, out in gen.outputs(request):
                if out.finished:
                    if out.pooled is None:
                        raise APIError(500, f"pooling failed: {out.error or 'engine error'}")
                    vectors[i] = out.pooled
        except GenerationEnded as exc:
            raise APIError(503 if exc.end.reason == "abort" else 500, exc.end.message) from None
        finally:
            gen.abort()
        return gen.prompt_tokens, vectors

    def _body(self, prefix: str, data: list[dict[str, Any]], prompts: list[int]) -> dict[str, Any]:
        tokens = sum(prompts)
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.serving.model_name, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                          "prompt_tokens_details": None}}  # fmt: skip


def _encode(vector: Any, encoding_format: str) -> list[float] | str:
    """A vector as a list of floats, or OpenAI's base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.tolist()  # type: ignore[no-any-return]
