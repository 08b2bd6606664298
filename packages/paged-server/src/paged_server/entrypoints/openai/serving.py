"""The two generation endpoints: /v1/completions and /v1/chat/completions.

Handlers tokenise, check the one thing only the API has an opinion on
(``prompt + max_tokens`` within ``max_model_len``, OpenAI's rule; the engine
stops at ``max_model_len`` instead), submit to the engine, then either stream
server-sent events or wait and return one JSON body. Everything else about
a prompt (empty, ids outside the vocabulary, too long, too big for the KV
pool) is checked once, by the engine, and its error mapped to a 400 once
(``generation.bad_value``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from paged_server.engine.sample.bad_words import index_bad_words
from paged_server.entrypoints.openai.async_engine import AsyncEngine
from paged_server.entrypoints.openai.chat_render import DEFAULT_RENDER_TIMEOUT_S, ChatRenderer
from paged_server.entrypoints.openai.completion_bodies import CollectedChoice, Echo, ResponseFormat
from paged_server.entrypoints.openai.errors import APIError
from paged_server.entrypoints.openai.generation import Generation, GenerationEnded, bad_value
from paged_server.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
    normalize_prompt,
)
from paged_server.entrypoints.openai.response_format import (
    request_constraint,
    response_format_constraint,
    tool_constraint,
)
from paged_server.entrypoints.openai.streaming import (
    EventStreamResponse,
    stream_chat,
    stream_completion,
)
from paged_server.entrypoints.openai.tool_calls import detect_parser
from paged_server.generation_defaults import NEUTRAL
from paged_server.lora_request import LoRARequest
from paged_server.output_constraint import StructuredOutputsParams
from paged_server.sampling_params import MAX_LOGPROBS, SamplingParams

T = TypeVar("T")
log = logging.getLogger("paged_server.entrypoints.openai")


# Texts longer than this are tokenised on a worker thread, so a 1 MiB prompt
# does not stall every other stream; short ones are cheaper inline.
OFF_LOOP_CHARS = 8192


async def _off_loop(fn: Callable[..., T], arg: Any, *, size: int) -> T:
    if size > OFF_LOOP_CHARS:
        return await asyncio.to_thread(fn, arg)
    return fn(arg)


class OpenAIServing:
    """Request handling shared by both endpoints; one per app."""

    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Any,
        *,
        model_name: str,
        max_model_len: int,
        tool_call_parser: str | None = None,
        settings: Any = None,
        max_logprobs: int = MAX_LOGPROBS,
        default_sampling: dict[str, Any] | None = None,
    ) -> None:
        # the model's sampling defaults (generation_defaults.py)
        self.default_sampling = dict(default_sampling or {})
        self.engine = engine
        self.max_logprobs = max_logprobs
        self.settings = settings
        # --chat-template: used instead of the tokenizer's
        self.chat_template: str | None = getattr(settings, "chat_template", None)
        self.renderer = ChatRenderer(
            tokenizer,
            chat_template=self.chat_template,
            trust_request_chat_template=getattr(settings, "trust_request_chat_template", False),
            timeout_s=getattr(settings, "chat_template_timeout_s", DEFAULT_RENDER_TIMEOUT_S),
        )
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        # None: the format the chat template speaks (tool_calls.detect_parser)
        self.tool_call_parser = tool_call_parser or detect_parser(
            getattr(tokenizer, "chat_template", None)
        )

    # ------------------------------------------------------------ endpoints
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        lora = self.check_model(body.model)
        raw_prompts = normalize_prompt(body.prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        encoded = [await self._encode_prompt(p, body.add_special_tokens) for p in raw_prompts]
        prompts = [self._truncate(ids, body, max_tokens) for ids in encoded]
        # max_tokens 0 (echo only): the engine generates one token, dropped.
        run_tokens = max(max_tokens, 1)
        for ids in prompts:
            self._check_length(len(ids), run_tokens, "prompt")
        constraint, constraint_param = request_constraint(body)
        if constraint is None:
            constraint_param = "response_format"
            constraint = response_format_constraint(body.response_format)
        params = self._params(body, run_tokens, logprobs=body.logprobs, structured_outputs=constraint,
                              truncate=self._truncate_limit(body, max_tokens))
        await self._index_bad_words(params)
        if body.echo and body.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = body.logprobs
        echo = None
        if body.echo:  # the prompt the model saw: a truncated one as its kept tokens read
            texts = [p if isinstance(p, str) and len(ids) == len(full) else self.tokenizer.decode(ids)
                     for p, full, ids in zip(raw_prompts, encoded, prompts, strict=True)]
            echo = Echo(texts, prompts, drop_generated=max_tokens == 0)
        gen = Generation(self.engine, _response_id("cmpl", body), body.n, arrival)
        await gen.submit(prompts, params, prompt_param="prompt", constraint_param=constraint_param,
                         lora_request=lora, priority=body.priority)
        self._log_request(gen, params, body)
        fmt = ResponseFormat(gen.request_id, self.served_name(lora), self.tokenizer,
                             include_usage=body.include_usage(), continuous_usage=body.continuous_usage(),
                             num_top=body.logprobs, echo=echo, n=body.n)
        self._shape(fmt, body, prompts)
        if body.stream:
            return EventStreamResponse(stream_completion(gen, fmt))
        return await self._complete(gen, fmt, request, chat=False)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        gen, fmt = await self.start_chat(body)
        if body.stream:
            return EventStreamResponse(stream_chat(gen, fmt))
        return await self._complete(gen, fmt, request, chat=True)

    async def start_chat(self, body: ChatCompletionRequest) -> tuple[Generation, ResponseFormat]:
        """A chat request checked, rendered and submitted: its generation and
        the format its outputs read in (also the start of /v1/responses and
        /v1/messages, which are chat requests in other clothes)."""
        arrival = time.monotonic()
        lora = self.check_model(body.model)
        self._check_auto_tool_choice(body)
        ids = await self.renderer.request_ids(body)
        requested = body.requested_max_tokens()
        ids = self._truncate(ids, body, requested)
        max_tokens = requested if requested is not None else max(1, self.max_model_len - len(ids))
        if requested is None and "max_tokens" in self.default_sampling:  # max_new_tokens
            max_tokens = min(max_tokens, int(self.default_sampling["max_tokens"]))
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        self._check_length(len(ids), max_tokens, "messages", max_tokens_param=param)
        num_top = (body.top_logprobs or 0) if body.logprobs else None
        constraint, constraint_param = request_constraint(body)
        forced = tool_constraint(body, self.tool_call_parser)
        if forced is not None:
            if constraint is not None:
                raise APIError(400, f"{constraint_param}: cannot be combined with a forced "
                               "tool_choice", param=constraint_param)
            constraint, constraint_param = forced, "tools"
        if constraint is None:
            constraint_param = "response_format"
            constraint = response_format_constraint(body.response_format)
        params = self._params(body, max_tokens, logprobs=num_top, structured_outputs=constraint,
                              aliases={"logprobs": "top_logprobs"},
                              truncate=self._truncate_limit(body, requested))
        await self._index_bad_words(params)
        gen = Generation(self.engine, _response_id("chatcmpl", body), body.n, arrival)
        await gen.submit([ids], params, prompt_param="messages", constraint_param=constraint_param,
                         lora_request=lora, priority=body.priority)
        self._log_request(gen, params, body)
        fmt = ResponseFormat(gen.request_id, self.served_name(lora), self.tokenizer,
                             include_usage=body.include_usage(), continuous_usage=body.continuous_usage(),
                             num_top=num_top)
        self._shape(fmt, body, [ids])
        if body.return_prompt_text:
            fmt.prompt_text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if body.effective_tool_choice() != "none":
            fmt.tool_call_parser = self.tool_call_parser
        settings = self.settings
        if settings is not None:
            fmt.role = settings.response_role
            fmt.reasoning_parser = settings.reasoning_parser
        fmt.include_reasoning = body.include_reasoning
        last = body.messages[-1]
        if body.echo and last.role == fmt.role:  # vLLM: the reply starts with that message
            fmt.chat_echo = last.text()
        return gen, fmt

    def _shape(self, fmt: ResponseFormat, body: _SamplingFields, prompts: list[list[int]]) -> None:
        """Response options both endpoints share."""
        as_ids = body.return_tokens_as_token_ids  # unset: the server's --return-tokens-as-token-ids
        if as_ids is None:
            as_ids = getattr(self.settings, "return_tokens_as_token_ids", False)
        fmt.tokens_as_ids = bool(as_ids)
        fmt.prompt_logprobs = body.prompt_logprobs is not None
        fmt.return_token_ids = bool(body.return_token_ids)
        fmt.prompt_token_ids = prompts

    def _truncate_limit(self, body: _SamplingFields, max_tokens: int | None) -> int | None:
        """``truncate_prompt_tokens`` as a token count: -1 is as many as fit
        beside ``max_tokens`` (vLLM's rule; one token when unset)."""
        k = body.truncate_prompt_tokens
        if k == -1:
            return max(1, self.max_model_len - (max_tokens or 1))
        return k

    def _truncate(self, ids: list[int], body: _SamplingFields, max_tokens: int | None) -> list[int]:
        """``truncate_prompt_tokens``: N of the prompt's tokens, its last N
        unless ``truncation_side`` is right (vLLM)."""
        k = self._truncate_limit(body, max_tokens)
        if k is None:
            return ids
        return ids[:k] if body.truncation_side == "right" else ids[-k:]

    def _log_request(self, gen: Generation, params: SamplingParams, body: _SamplingFields) -> None:
        """``--enable-log-requests``: one line per request (lengths, not text)."""
        if self.settings is not None and self.settings.log_requests:
            log.info("received request %s (user %s): prompt tokens %s, params %s",
                     gen.request_id, body.user, gen.prompt_tokens, params)

    # -------------------------------------------------------------- checks
    def _check_auto_tool_choice(self, body: ChatCompletionRequest) -> None:
        """Without --enable-auto-tool-choice, tools may only be forced (vLLM's rule)."""
        enabled = self.settings is None or self.settings.enable_auto_tool_choice
        if not enabled and body.tools and body.effective_tool_choice() == "auto":
            raise APIError(
                400,
                'tool_choice: "auto" needs the server started with --enable-auto-tool-choice; '
                'send "none", "required" or a named function',
                param="tool_choice",
            )

    def loras(self) -> dict[str, LoRARequest]:
        """The LoRA adapters served now, by name (a copy: the engine thread loads and unloads)."""
        return dict(getattr(self.engine.engine, "lora_requests", None) or {})

    def check_model(self, model: str | None) -> LoRARequest | None:
        """A 404 unless ``model`` is served here; the LoRA adapter it names
        (None: the base model, under its name or an alias)."""
        aliases = getattr(self.settings, "model_aliases", ())
        if model is None or model == self.model_name or model in aliases:
            return None
        loras = self.loras()
        if model in loras:
            return loras[model]
        adapters = f" and the LoRA adapters {', '.join(map(repr, loras))}" if loras else ""
        raise APIError(
            404,
            f"model: '{model}' is not served here; this server serves '{self.model_name}'"
            f"{adapters} (see GET /v1/models)",
            param="model",
            code="model_not_found",
        )

    def served_name(self, lora: LoRARequest | None) -> str:
        """The ``model`` a response names: the adapter's, else the served model's."""
        return self.model_name if lora is None else lora.lora_name

    async def _encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            encode = functools.partial(self.tokenizer.encode, add_special_tokens=add_special_tokens)
            return list(await _off_loop(encode, prompt, size=len(prompt)))
        return list(prompt)

    def _check_length(
        self, n_prompt: int, max_tokens: int, param: str, max_tokens_param: str = "max_tokens"
    ) -> None:
        """``max_tokens`` must fit beside the prompt; a prompt that alone does
        not fit is the engine's to report."""
        limit = self.max_model_len
        if n_prompt < limit and n_prompt + max_tokens > limit:
            raise APIError(
                400,
                f"{max_tokens_param}: prompt has {n_prompt} tokens and {max_tokens_param} is "
                f"{max_tokens}, more than max_model_len {limit} in total; ask for at most "
                f"{limit - n_prompt} tokens",
                param=max_tokens_param,
                code="context_length_exceeded",
            )

    def _default(self, body: _SamplingFields, name: str) -> Any:
        """The request's value, else the model's default (generation_config.json;
        not for beam search, whose scores must stay raw), else the neutral one."""
        value = getattr(body, name)
        if value is not None:
            return value
        if not body.use_beam_search and name in self.default_sampling:
            return self.default_sampling[name]
        return NEUTRAL[name]

    def _params(
        self,
        body: _SamplingFields,
        max_tokens: int,
        *,
        logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
        aliases: dict[str, str] | None = None,
        truncate: int | None = None,
    ) -> SamplingParams:
        params = SamplingParams(
            n=body.n,
            max_tokens=max_tokens,
            temperature=self._default(body, "temperature"),
            top_p=self._default(body, "top_p"),
            top_k=max(0, self._default(body, "top_k")),
            min_p=self._default(body, "min_p"),
            repetition_penalty=self._default(body, "repetition_penalty"),
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            seed=body.seed,
            stop=body.stop_list(),
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            logit_bias=body.logit_bias_ids(),
            min_tokens=body.min_tokens,
            structured_outputs=structured_outputs,
            use_beam_search=body.use_beam_search,
            best_of=getattr(body, "best_of", None) if body.use_beam_search else None,
            length_penalty=body.length_penalty,
            early_stopping=body.early_stopping,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            bad_words=list(body.bad_words or []),
            allowed_token_ids=body.allowed_token_ids,
            truncate_prompt_tokens=truncate,
            prompt_logprobs=body.prompt_logprobs,
        )
        try:
            params.validate(self.max_model_len, self.max_logprobs)
        except ValueError as exc:
            raise bad_value(exc, aliases=aliases) from None
        return params

    async def _index_bad_words(self, params: SamplingParams) -> None:
        """``bad_words`` as token ids, built here (a long list on a worker
        thread) so the engine thread, which steps every stream, never does."""
        if params.bad_words:
            index = functools.partial(index_bad_words, self.tokenizer)
            size = sum(len(w) for w in params.bad_words)
            params.bad_words_index = await _off_loop(index, params.bad_words, size=size)

    # -------------------------------------------------------- non-streaming
    async def _complete(
        self, gen: Generation, fmt: ResponseFormat, request: Request, *, chat: bool
    ) -> Response:
        """Wait for every choice, then answer with one JSON body."""
        choices = await self.collect(gen, request)
        prompt_tokens, cached = sum(gen.prompt_tokens), gen.cached_tokens
        body = (
            fmt.chat_body(choices, prompt_tokens, cached)
            if chat
            else fmt.completion_body(choices, prompt_tokens, cached)
        )
        return JSONResponse(body)

    async def collect(self, gen: Generation, request: Request) -> list[CollectedChoice]:
        """Every choice of ``gen`` once all have finished; engine failures
        as 500s (503 when the engine aborted them, as at shutdown)."""
        choices = [CollectedChoice() for _ in range(len(gen.engine_ids) * gen.n)]
        try:
            async for i, out in gen.outputs(request):
                choices[i].add(out)
        except GenerationEnded as exc:
            status = 503 if exc.end.reason == "abort" else 500
            raise APIError(status, exc.end.message) from None
        finally:
            gen.abort()
        failed = [c.error for c in choices if c.error or c.finish_reason == "error"]
        if failed:
            raise APIError(500, f"generation failed: {failed[0] or 'engine error'}")
        return choices


def _response_id(prefix: str, body: _SamplingFields) -> str:
    """``<prefix>-<request_id>``: the client's id (vLLM's field), else a random one."""
    return f"{prefix}-{body.request_id or uuid.uuid4().hex}"
