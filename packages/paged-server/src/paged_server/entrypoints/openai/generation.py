"""One HTTP request's life in the engine: submit its prompts, yield outputs, abort.

A completion request may carry several prompts, each with ``n`` choices; the
engine sees one request per prompt (``<id>-<prompt index>``) and numbers the
choices of each from 0. This class maps them back to OpenAI's flat choice
index ``prompt_index * n + choice``, and aborts whatever is unfinished when
the HTTP request ends early (client gone, error, shutdown).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from paged_server.entrypoints.openai.async_engine import AsyncEngine, EngineDeadError, StreamEnd
from paged_server.entrypoints.openai.errors import APIError
from paged_server.errors import ContextLengthError, QueueFullError

DISCONNECT_POLL_S = 1.0


class GenerationEnded(Exception):
    """The engine closed this request's stream early (shutdown or a failed step)."""

    def __init__(self, end: StreamEnd) -> None:
        super().__init__(end.message)
        self.end = end


class Generation:
    """The engine requests behind one HTTP request."""

    def __init__(self, engine: AsyncEngine, request_id: str, n: int, arrival: float) -> None:
        self.engine = engine
        self.request_id = request_id
        self.n = n
        self.arrival = arrival
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.engine_ids: list[str] = []
        self.prompt_tokens: list[int] = []
        self._cached_tokens: dict[str, int] = {}  # engine request -> prefix-cache hits
        self._prompt_index: dict[str, int] = {}
        self._unfinished: set[str] = set()
        self._checked_at = time.monotonic()  # last client-disconnect poll

    async def submit(
        self,
        prompts: list[list[int]],
        params: Any,
        *,
        prompt_param: str,
        constraint_param: str = "response_format",
        lora_request: Any = None,
        priority: int = 0,
    ) -> None:
        """Add every prompt to the engine; on any failure abort the ones
        added. Errors name ``prompt_param`` for the prompt and
        ``constraint_param`` for the grammar (``response_format`` or ``tools``).
        ``lora_request``: the LoRA adapter serving them (None: the base model);
        ``priority``: their scheduling priority (--scheduling-policy priority)."""
        try:
            for i, prompt in enumerate(prompts):
                engine_id = f"{self.request_id}-{i}"
                # Marked before the await: if the client goes away while the add
                # is queued, abort() still reaches it (commands run in order).
                self._unfinished.add(engine_id)
                n_prompt = await self.engine.add_request(
                    engine_id, prompt, params, self.queue, arrival=self.arrival, num_choices=self.n,
                    lora_request=lora_request, priority=priority,
                )
                self.engine_ids.append(engine_id)
                self._prompt_index[engine_id] = i
                self.prompt_tokens.append(n_prompt)
        except QueueFullError as exc:
            self.abort()
            raise APIError(
                503,
                f"the server is busy ({exc or 'waiting queue is full'}); retry shortly",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        except EngineDeadError as exc:
            self.abort()
            raise APIError(503, f"the engine is not running: {exc}", code="engine_unavailable") from None
        except ValueError as exc:
            self.abort()
            names = {"prompt": prompt_param, "structured_outputs": constraint_param}
            raise bad_value(exc, default_param=prompt_param, aliases=names) from None
        except BaseException:
            self.abort()
            raise

    async def outputs(self, request: Request | None = None) -> AsyncIterator[tuple[int, Any]]:
        """``(choice index, RequestOutput)`` until every choice has finished.

        With ``request`` (non-streaming), polls for a client disconnect while
        waiting and aborts if the client is gone.
        """
        remaining = len(self.engine_ids) * self.n
        while remaining > 0:
            item = await self._next(request)
            if isinstance(item, StreamEnd):
                self._unfinished.clear()  # the engine thread aborted them already
                raise GenerationEnded(item)
            for out in item:
                self._cached_tokens[out.request_id] = out.num_cached_tokens
                choice = self._prompt_index[out.request_id] * self.n + out.index
                if out.finished:
                    remaining -= 1
                yield choice, out
        self._unfinished.clear()

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (each prompt's first
        admission), for ``usage.prompt_tokens_details.cached_tokens``."""
        return sum(self._cached_tokens.values())

    async def _next(self, request: Request | None) -> Any:
        if request is None:
            return await self.queue.get()
        while True:
            if time.monotonic() - self._checked_at >= DISCONNECT_POLL_S:
                self._checked_at = time.monotonic()
                if await request.is_disconnected():
                    self.abort()
                    # 499 (nginx's "client closed request"): nobody reads it, but
                    # the handler ends normally instead of as a crash in the logs.
                    raise APIError(499, "client disconnected before the response was ready")
            try:
                return await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                continue

    def abort(self) -> None:
        """Abort every engine request of this generation that may still run."""
        for engine_id in list(self._unfinished):
            with contextlib.suppress(EngineDeadError):
                self.engine.abort(engine_id)
        self._unfinished.clear()


def bad_value(
    exc: ValueError, *, default_param: str | None = None, aliases: dict[str, str] | None = None
) -> APIError:
    """A 400 from a ``ValueError("<field>: what is wrong")``, naming the
    field; ``aliases`` rename engine fields to the request's (the engine says
    "prompt" where chat requests say "messages")."""
    message = str(exc)
    head, sep, rest = message.partition(":")
    if not (sep and head.isidentifier()):  # no field named: the message stays whole
        param = default_param
    elif head in (aliases or {}):
        param = (aliases or {})[head]
        message = f"{param}:{rest}"
    else:
        param = head
    code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else "invalid_value"
    return APIError(400, message, param=param, code=code)
