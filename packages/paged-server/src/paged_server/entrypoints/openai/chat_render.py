"""A conversation to token ids through a chat template, off the event loop.

The template is the request's ``chat_template`` (only with
``--trust-request-chat-template``, as vLLM), else ``--chat-template``'s,
else the model's. Every render runs on a thread of its own with a time
budget: past it the request gets a 400 and the render is stopped (an
exception raised in its thread, which Python delivers between bytecodes,
so a template's loops end there; the sandbox keeps single steps short).
The event loop, ``/health`` and SIGTERM never wait on a template.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jinja2

from paged_server.entrypoints.openai.errors import APIError
from paged_server.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage

T = TypeVar("T")

# Seconds a chat template may render one conversation. Real templates take
# milliseconds on the longest conversations a body can carry.
DEFAULT_RENDER_TIMEOUT_S = 10.0
# Renders at once: each holds the GIL while it runs, so more would starve
# the event loop rather than add speed.
MAX_CONCURRENT_RENDERS = 4
# Variables the request's own fields set (vLLM lets those fields win too).
_SET_BY_REQUEST = ("messages", "tools", "add_generation_prompt")
UNTRUSTED = (
    "chat_template: a chat template was sent with the request, but the server was not started "
    "with --trust-request-chat-template; refused the untrusted template (send none to use "
    "the server's)"
)


class ChatRenderer:
    """Renders conversations for the chat and ``/tokenize`` endpoints."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        trust_request_chat_template: bool = False,
        timeout_s: float = DEFAULT_RENDER_TIMEOUT_S,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # --chat-template, else the model's
        self.trust_request_chat_template = trust_request_chat_template
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_RENDERS)

    async def request_ids(self, body: ChatCompletionRequest) -> list[int]:
        """The prompt ids of a chat completion request."""
        tools = None
        if body.tools and body.effective_tool_choice() != "none":
            tools = [t.model_dump(exclude_none=True) for t in body.tools]
        variables: dict[str, Any] = dict(body.chat_template_kwargs or {})
        for name in _SET_BY_REQUEST:
            if name in variables:
                raise APIError(400, f"chat_template_kwargs: {name!r} is set by the request itself",
                               param="chat_template_kwargs")
        # vLLM takes a template from chat_template_kwargs as the request's too.
        template = body.chat_template
        kwarg_template = variables.pop("chat_template", None)
        if template is None and isinstance(kwarg_template, str):
            template = kwarg_template
        if body.documents is not None:
            variables["documents"] = body.documents
        if body.reasoning_effort is not None:
            variables["reasoning_effort"] = body.reasoning_effort
            # vLLM: templates that need thinking switched on (Gemma 4) get it
            variables.setdefault("enable_thinking", body.reasoning_effort != "none")
        return await self.messages_ids(
            body.messages, body.add_generation_prompt, tools,
            chat_template=template,
            continue_final_message=body.continue_final_message,
            add_special_tokens=body.add_special_tokens,
            variables=variables,
        )

    async def messages_ids(
        self,
        chat: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a conversation (and its tools) through the chat
        template: the request's (``chat_template``), else the server's."""
        if chat_template is not None and not self.trust_request_chat_template:
            raise APIError(400, UNTRUSTED, param="chat_template")
        messages = [_template_message(m) for m in chat]
        context = {**(variables or {}), "tools": tools}

        def render() -> list[int]:
            text = self.tokenizer.render_chat(
                messages, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template or self.chat_template,
                continue_final_message=continue_final_message, variables=context,
            )
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

        from_request = chat_template is not None
        try:
            async with self._slots:
                return await run_with_budget(render, self.timeout_s)
        except TimeoutError:
            raise _timed_out(self.timeout_s, from_request) from None
        except APIError:
            raise
        except Exception as exc:
            raise _template_failed(exc, from_request) from None


def _timed_out(timeout_s: float, from_request: bool) -> APIError:
    limit = f"{timeout_s:g} s, the server's limit for rendering a chat template"
    if from_request:
        return APIError(400, f"chat_template: the request's chat template ran longer than {limit}; "
                        "send a template that renders in less", param="chat_template")
    return APIError(400, f"messages: the chat template ran longer than {limit}; send a shorter "
                    "conversation", param="messages")


def _template_failed(exc: Exception, from_request: bool) -> APIError:
    """A 400 naming the template (the request's) or the messages (the
    server's template rejected them)."""
    if isinstance(exc, ValueError) and not isinstance(exc, jinja2.TemplateError):
        # no chat template, or nothing to continue (tokenizer.render_chat)
        text = str(exc)
        param = "continue_final_message" if text.startswith("continue_final_message") else "messages"
        return APIError(400, text if param != "messages" else f"messages: {text}", param=param)
    what = exc if isinstance(exc, jinja2.TemplateError) else f"{type(exc).__name__}: {exc}"
    if isinstance(exc, jinja2.TemplateSyntaxError):
        what = f"not a valid Jinja template (line {exc.lineno}): {exc.message}"
    if from_request:
        return APIError(400, f"chat_template: the request's chat template failed: {what}",
                        param="chat_template")
    return APIError(400, f"messages: the chat template rejected them: {what}", param="messages")


def _template_message(m: ChatMessage) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name is not None:
        msg["name"] = m.name
    if m.tool_calls:
        msg["tool_calls"] = [_template_tool_call(c.model_dump()) for c in m.tool_calls]
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    return msg


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A history tool call as chat templates expect it: ``arguments`` as an
    object when it is JSON (Llama's template dumps it with ``tojson``)."""
    function = dict(call["function"])
    with contextlib.suppress(ValueError):  # not JSON: templates that print text still work
        function["arguments"] = json.loads(function["arguments"])
    return {**call, "function": function}


# ------------------------------------------------------------ the budget
class _Stop(BaseException):
    """Raised inside a render thread whose budget ran out (a BaseException,
    so no ``except Exception`` in the render swallows it)."""


class _Render:
    """One render's thread and whether it may still be stopped."""

    __slots__ = ("done", "lock", "stopped", "thread_id")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False
        self.stopped = False
        self.thread_id = 0


async def run_with_budget(fn: Callable[[], T], timeout_s: float) -> T:
    """``fn()`` on a thread of its own; ``TimeoutError`` after ``timeout_s``,
    and the thread is stopped then (or when the caller is cancelled) rather
    than left running: Python raises ``_Stop`` in it at its next bytecode."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    render = _Render()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def target() -> None:
        outcome: tuple[Any, BaseException | None] | None = None
        try:
            try:
                outcome = (fn(), None)
            except _Stop:
                raise
            except BaseException as exc:  # handed to the awaiting request
                outcome = (None, exc)
            finally:
                with render.lock:
                    render.done = True
                    if render.stopped:  # sent but maybe not delivered: withdraw it
                        _raise_in_thread(render.thread_id, None)
        except _Stop:
            return  # the request was answered without it
        if outcome is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(settle, *outcome)

    thread = threading.Thread(target=target, name="chat-template", daemon=True)
    thread.start()
    render.thread_id = thread.ident or 0
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout_s)
    except BaseException:  # past the budget, or the request went away
        with render.lock:
            if not render.done and not render.stopped:
                render.stopped = True
                _raise_in_thread(render.thread_id, _Stop)
        raise


def _raise_in_thread(thread_id: int, exc: type[BaseException] | None) -> None:
    """CPython's ``PyThreadState_SetAsyncExc``: ``exc`` raised in that thread
    at its next bytecode (``None`` withdraws one not yet raised)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None
    )
