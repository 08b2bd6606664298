"""The two generation endpoints: /v1/completions and /v1/chat/completions.

Handlers validate what depends on the model (token ids against the
vocabulary, prompt and max_tokens against ``max_seq_len``), tokenise,
submit to the engine, then either stream server-sent events or wait and
return one JSON body. Prompts are tokenised here so that length errors can
state both numbers before anything is queued.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import jinja2
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from paged_server.api.async_engine import AsyncEngine
from paged_server.api.errors import APIError, error_body
from paged_server.api.generation import Generation, GenerationEnded, bad_value
from paged_server.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
    normalize_prompt,
)
from paged_server.api.streaming import DONE, EventStreamResponse, sse
from paged_server.sampling_params import SamplingParams

T = TypeVar("T")


# Texts longer than this are tokenised on a worker thread, so a 1 MiB prompt
# does not stall every other stream; short ones are cheaper inline.
OFF_LOOP_CHARS = 8192


async def _off_loop(fn: Callable[..., T], arg: Any, *, size: int) -> T:
    if size > OFF_LOOP_CHARS:
        return await asyncio.to_thread(fn, arg)
    return fn(arg)


@dataclass(slots=True)
class _Choice:
    """Everything one choice produced, for the non-streaming body."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_generated: int = 0


class OpenAIServing:
    """Request handling shared by both endpoints; one per app."""

    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Any,
        *,
        model_name: str,
        max_seq_len: int,
        vocab_size: int,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size

    # ------------------------------------------------------------ endpoints
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self._check_model(body.model)
        prompts = [await self._encode_prompt(p) for p in normalize_prompt(body.prompt)]
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        for ids in prompts:
            self._check_length(len(ids), max_tokens, "prompt")
        params = self._params(body, max_tokens, logprobs=body.logprobs is not None)
        gen = Generation(self.engine, f"cmpl-{uuid.uuid4().hex}", body.n, arrival)
        await gen.submit(prompts, params, prompt_param="prompt")
        if body.stream:
            return EventStreamResponse(self._stream_completion(gen, body))
        return await self._complete(gen, request, chat=False)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self._check_model(body.model)
        ids = await _off_loop(self._render_chat, body, size=sum(len(m.text()) for m in body.messages))
        requested = body.requested_max_tokens()
        max_tokens = requested if requested is not None else max(1, self.max_seq_len - len(ids))
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        self._check_length(len(ids), max_tokens, "messages", max_tokens_param=param)
        params = self._params(body, max_tokens, logprobs=body.logprobs)
        gen = Generation(self.engine, f"chatcmpl-{uuid.uuid4().hex}", body.n, arrival)
        await gen.submit([ids], params, prompt_param="messages")
        if body.stream:
            return EventStreamResponse(self._stream_chat(gen, body))
        return await self._complete(gen, request, chat=True)

    # -------------------------------------------------------------- checks
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"model: '{model}' is not served here; this server serves '{self.model_name}' "
                "(see GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    async def _encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(await _off_loop(self.tokenizer.encode, prompt, size=len(prompt)))
        bad = [t for t in prompt if t >= self.vocab_size]
        if bad:
            raise APIError(
                400,
                f"prompt: token id {bad[0]} is out of range; the vocabulary has {self.vocab_size} ids",
                param="prompt",
                code="invalid_value",
            )
        return list(prompt)

    def _check_length(
        self, n_prompt: int, max_tokens: int, param: str, max_tokens_param: str = "max_tokens"
    ) -> None:
        limit = self.max_seq_len
        if n_prompt == 0:
            raise APIError(400, f"{param}: the prompt is empty after tokenisation", param=param)
        if n_prompt >= limit:
            raise APIError(
                400,
                f"{param}: prompt has {n_prompt} tokens but max_seq_len is {limit} "
                f"(prompt + generated tokens); shorten the prompt to at most {limit - 1} tokens",
                param=param,
                code="context_length_exceeded",
            )
        if n_prompt + max_tokens > limit:
            raise APIError(
                400,
                f"{max_tokens_param}: prompt has {n_prompt} tokens and {max_tokens_param} is "
                f"{max_tokens}, more than max_seq_len {limit} in total; ask for at most "
                f"{limit - n_prompt} tokens",
                param=max_tokens_param,
                code="context_length_exceeded",
            )

    def _render_chat(self, body: ChatCompletionRequest) -> list[int]:
        messages = []
        for m in body.messages:
            msg: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name is not None:
                msg["name"] = m.name
            messages.append(msg)
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt, tokenize=True
            )
        except jinja2.TemplateError as exc:
            raise APIError(
                400, f"messages: the model's chat template rejected them: {exc}", param="messages"
            ) from None
        except ValueError as exc:  # no chat template
            raise APIError(400, f"messages: {exc}", param="messages") from None
        return list(ids)

    def _params(self, body: _SamplingFields, max_tokens: int, *, logprobs: bool) -> SamplingParams:
        params = SamplingParams(
            n=body.n,
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(0, body.top_k),
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            seed=body.seed,
            stop=body.stop_list(),
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
        )
        try:
            params.validate(self.max_seq_len)
        except ValueError as exc:
            raise bad_value(exc) from None
        return params

    # -------------------------------------------------------- non-streaming
    async def _complete(self, gen: Generation, request: Request, *, chat: bool) -> Response:
        choices = [_Choice() for _ in range(len(gen.engine_ids) * gen.n)]
        try:
            async for i, out in gen.outputs(request):
                c = choices[i]
                c.text.append(out.new_text)
                c.token_ids.extend(out.new_token_ids)
                if out.new_logprobs:
                    c.logprobs.extend(out.new_logprobs)
                if out.finished:
                    c.finish_reason = out.finish_reason
                    c.error = out.error
                    c.num_generated = out.num_generated_tokens
        except GenerationEnded as exc:
            status = 503 if exc.end.reason == "abort" else 500
            raise APIError(status, exc.end.message) from None
        finally:
            gen.abort()
        failed = [c.error for c in choices if c.error or c.finish_reason == "error"]
        if failed:
            raise APIError(500, f"generation failed: {failed[0] or 'engine error'}")
        usage = self._usage(gen, sum(c.num_generated or len(c.token_ids) for c in choices))
        created = int(time.time())
        if chat:
            body: dict[str, Any] = {
                "id": gen.request_id,
                "object": "chat.completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": "".join(c.text)},
                        "logprobs": self._chat_logprobs(c.token_ids, c.logprobs)
                        if c.logprobs
                        else None,
                        "finish_reason": c.finish_reason,
                    }
                    for i, c in enumerate(choices)
                ],
                "usage": usage,
            }
        else:
            body = {
                "id": gen.request_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": i,
                        "text": "".join(c.text),
                        "logprobs": self._completion_logprobs(c.token_ids, c.logprobs, 0)
                        if c.logprobs
                        else None,
                        "finish_reason": c.finish_reason,
                    }
                    for i, c in enumerate(choices)
                ],
                "usage": usage,
            }
        return JSONResponse(body)

    # ------------------------------------------------------------ streaming
    async def _stream_completion(
        self, gen: Generation, body: CompletionRequest
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        include_usage = body.include_usage()
        offsets = [0] * (len(gen.engine_ids) * gen.n)
        generated = 0

        def chunk(choice: dict[str, Any]) -> bytes:
            payload: dict[str, Any] = {
                "id": gen.request_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [choice],
            }
            if include_usage:
                payload["usage"] = None
            return sse(payload)

        try:
            async for i, out in gen.outputs():
                if out.error:
                    yield sse(error_body(f"generation failed: {out.error}", "server_error"))
                if not out.new_text and not out.finished and not out.new_logprobs:
                    continue
                logprobs = None
                if out.new_logprobs:
                    logprobs = self._completion_logprobs(out.new_token_ids, out.new_logprobs, offsets[i])
                offsets[i] += len(out.new_text)
                if out.finished:
                    generated += out.num_generated_tokens
                yield chunk(
                    {
                        "index": i,
                        "text": out.new_text,
                        "logprobs": logprobs,
                        "finish_reason": out.finish_reason if out.finished else None,
                    }
                )
            if include_usage:
                yield sse(self._usage_chunk(gen, "text_completion", created, generated))
        except GenerationEnded as exc:
            yield sse(error_body(exc.end.message, "server_error", code=exc.end.reason))
        finally:
            gen.abort()
        yield DONE

    async def _stream_chat(
        self, gen: Generation, body: ChatCompletionRequest
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        include_usage = body.include_usage()
        generated = 0

        def chunk(index: int, delta: dict[str, Any], finish: str | None, logprobs: Any = None) -> bytes:
            payload: dict[str, Any] = {
                "id": gen.request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                ],
            }
            if include_usage:
                payload["usage"] = None
            return sse(payload)

        try:
            for i in range(gen.n):  # OpenAI opens every choice with the role
                yield chunk(i, {"role": "assistant", "content": ""}, None)
            async for i, out in gen.outputs():
                if out.error:
                    yield sse(error_body(f"generation failed: {out.error}", "server_error"))
                if out.new_text or out.new_logprobs:
                    logprobs = None
                    if out.new_logprobs:
                        logprobs = self._chat_logprobs(out.new_token_ids, out.new_logprobs)
                    yield chunk(i, {"content": out.new_text}, None, logprobs)
                if out.finished:
                    generated += out.num_generated_tokens
                    yield chunk(i, {}, out.finish_reason)
            if include_usage:
                yield sse(self._usage_chunk(gen, "chat.completion.chunk", created, generated))
        except GenerationEnded as exc:
            yield sse(error_body(exc.end.message, "server_error", code=exc.end.reason))
        finally:
            gen.abort()
        yield DONE

    # ------------------------------------------------------------- helpers
    @staticmethod
    def _usage(gen: Generation, completion_tokens: int) -> dict[str, int]:
        prompt = sum(gen.prompt_tokens)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }

    def _usage_chunk(self, gen: Generation, obj: str, created: int, generated: int) -> dict[str, Any]:
        return {
            "id": gen.request_id,
            "object": obj,
            "created": created,
            "model": self.model_name,
            "choices": [],
            "usage": self._usage(gen, generated),
        }

    def _token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def _completion_logprobs(
        self, token_ids: list[int], logprobs: list[float], start_offset: int
    ) -> dict[str, Any]:
        tokens = [self._token_text(t) for t in token_ids[: len(logprobs)]]
        offsets, pos = [], start_offset
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(lp) for lp in logprobs],
            "top_logprobs": None,
            "text_offset": offsets,
        }

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[float]) -> dict[str, Any]:
        content = []
        for tid, lp in zip(token_ids, logprobs, strict=False):
            tok = self._token_text(tid)
            content.append(
                {"token": tok, "logprob": _finite(lp), "bytes": list(tok.encode()), "top_logprobs": []}
            )
        return {"content": content}


def _finite(logprob: float) -> float:
    """JSON has no -Infinity; OpenAI reports impossible tokens as -9999.0."""
    return logprob if math.isfinite(logprob) else -9999.0
