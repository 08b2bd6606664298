"""The async front of the engine: one background thread owns the `LLMEngine`.

The event loop never runs a forward pass. Everything that touches the engine
(add, abort, audit, step) runs on the engine thread, in order, so the engine
needs no locks. Handlers talk to it through commands (a thread-safe queue,
answered with `concurrent.futures.Future`s) and receive outputs on their own
`asyncio.Queue`, fed with ``loop.call_soon_threadsafe`` after every step;
on a CPU, the engine thread then waits (at most ``HANDOFF_WAIT_S``) until the
loop has run the streams it woke, so a step's tokens are written before the
next forward pass takes the GIL.

The thread that steps the engine should be the one that loaded its model
(`EngineThread`): torch's OpenMP pool belongs to the thread that first runs a
parallel op, and with a second pool alive (2 cores, 2 pools) libgomp stops
busy-waiting, so every op of every step pays a thread wake-up.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from paged_server.entrypoints.openai.metrics import ServerMetrics
from paged_server.entrypoints.openai.stats_logger import StatsLogger
from paged_server.errors import EngineFailedError
from paged_server.platform import platform_for, resolve_device

if TYPE_CHECKING:
    from paged_server.config import RunConfig
    from paged_server.engine.kv.pool_factory import PoolCapacity
    from paged_server.tokenizer import Tokenizer

logger = logging.getLogger("paged_server.entrypoints.openai")

# How long the engine thread waits, after handing a step's outputs to the
# event loop, for the loop to write them before it starts the next step. A
# compiled forward pass holds the GIL for most of its length (inductor's CPU
# kernels do not release it), so a delivery still pending when the pass
# starts waits for the pass to end, and those late writes were the
# inter-token latency's tail (docs/cpu.md). Bounded: a busy or stuck loop never holds the engine
# longer than this per step. Not on a GPU: its pass leaves the GIL free while
# the device computes, so the loop writes meanwhile, and waiting would idle
# the device.
HANDOFF_WAIT_S = 0.002


class EngineLike(Protocol):
    """The part of `paged_server.engine.LLMEngine` the server uses (docs/contracts.md)."""

    config: RunConfig  # the config as run
    capacity: PoolCapacity  # the KV cache's size, for metrics and the start-up line
    tokenizer: Tokenizer
    default_sampling: dict[str, Any]  # the model's sampling defaults (generation_defaults.py)

    # The prompt's token count, or (data parallelism) a future of it that the
    # engine resolves from a later step(): it fails with what add_request would raise.
    def add_request(
        self, request_id: str, prompt: Any, params: Any
    ) -> int | concurrent.futures.Future[int]: ...
    def abort_request(self, request_id: str) -> None: ...
    def step(self) -> list[Any]: ...
    def has_unfinished(self) -> bool: ...
    def metrics(self) -> dict[str, float]: ...
    def audit(self) -> list[str]: ...
    def reclaim_leaked(self) -> list[int]: ...
    def parallel_summary(self) -> str | None: ...
    def shutdown(self) -> None: ...


@dataclass(slots=True)
class StreamEnd:
    """Put on a request's queue when it ends without a normal finish: the
    server shuts down (``abort``) or the engine step failed (``error``)."""

    reason: str
    message: str


@dataclass(slots=True)
class _Tracked:
    """A request in flight: ``remaining`` is the engine thread's;
    ``first_token_at``, ``last_token_at`` and ``generated`` are the event
    loop's (observed as outputs arrive there); the rest never change."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]
    arrival: float
    remaining: int  # choices not finished yet
    n: int = 1  # choices asked for
    max_tokens: int | None = None  # the request's max_tokens
    first_token_at: float | None = None
    last_token_at: dict[int, float] = field(default_factory=dict)
    generated: dict[int, int] = field(default_factory=dict)  # choice -> tokens so far


class EngineDeadError(RuntimeError):
    """The engine thread is not running; the server cannot take requests."""


class EngineThread:
    """One daemon thread that runs what it is given, in order: first the
    engine's construction (``call(build)``: loading the model starts torch's
    thread pool on this thread), then `AsyncEngine`'s step loop, so one
    thread pool does all the model's work."""

    def __init__(self, name: str = "paged-engine") -> None:
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None
        ] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn()`` on this thread after what was submitted before."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((fn, fut))
        return fut

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on this thread and return its result (or raise its error)."""
        return self.submit(fn).result()

    def close(self, timeout: float | None = None) -> None:
        """End the thread once what was submitted before has run; wait up to
        ``timeout`` seconds for that (0: do not wait)."""
        self._jobs.put(None)
        if timeout != 0:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the caller
                fut.set_exception(exc)


class AsyncEngine:
    """Runs ``engine.step()`` in a loop on one thread and routes its outputs."""

    def __init__(
        self,
        engine: EngineLike,
        metrics: ServerMetrics | None = None,
        audit_interval_s: float = 0.0,
        thread: EngineThread | None = None,
        stats_logger: StatsLogger | None = None,
    ) -> None:
        self.engine = engine
        # config.device is as run (a data-parallel engine's: its first
        # replica's); an unresolved ``auto`` is resolved as config.resolve does
        device = engine.config.device
        waits = platform_for(resolve_device(device) if device == "auto" else device).waits_for_event_loop
        self.handoff_wait_s = HANDOFF_WAIT_S if waits else 0.0
        self.stats_logger = stats_logger  # the periodic stats line (None: off)
        self._engine_thread = thread  # the thread that built the engine, if known
        self._own_thread = False  # True: started here, ended by stop()
        self.audit_interval_s = audit_interval_s  # while idle; 0 = never
        self._last_audit = time.monotonic()
        self.server_metrics = metrics
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any] | None]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._snapshot: dict[str, float] = {}
        if metrics is not None:
            metrics.read_engine_from(self.metrics)
        self._loop_done: concurrent.futures.Future[Any] | None = None
        self._submit_lock = threading.Lock()
        self._closed = False
        self.step_errors = 0
        self.aborted_at_shutdown = 0
        self.last_error: str | None = None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the step loop on the engine's thread (a new one when the
        engine was built elsewhere) and take a first metrics snapshot."""
        if self._loop_done is not None:
            raise RuntimeError("AsyncEngine.start() called twice")
        self._snapshot = dict(self.engine.metrics())
        if self._engine_thread is None:
            self._engine_thread, self._own_thread = EngineThread(), True
        self._loop_done = self._engine_thread.submit(self._run)

    @property
    def alive(self) -> bool:
        return self._loop_done is not None and not self._loop_done.done() and not self._stopping.is_set()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort every in-flight request, close its stream, and end the step loop."""
        if self._loop_done is None:
            return
        self._stopping.set()
        self._wake.set()
        done, _ = concurrent.futures.wait([self._loop_done], timeout)
        if not done:
            logger.warning("engine thread did not stop within %.0f s (a step is still running)", timeout)
        elif self._own_thread and self._engine_thread is not None:
            self._engine_thread.close(timeout)

    # ------------------------------------------------------- event-loop API
    async def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: Any,
        out: asyncio.Queue[Any],
        *,
        arrival: float,
        num_choices: int,
        prepare: Callable[[Any], Any] | None = None,
        lora_request: Any = None,
        priority: int = 0,
    ) -> int:
        """Queue a request; returns its prompt token count.

        Outputs (lists of ``RequestOutput``) and `StreamEnd` arrive on ``out``.
        ``prepare`` turns ``prompt`` into what the engine takes, on the engine
        thread (tokenising there keeps the tokenizer single-threaded);
        ``lora_request``: the LoRA adapter serving it (None: the base model);
        ``priority``: its scheduling priority (passed on when not 0). Raises
        whatever ``engine.add_request`` raises (``ValueError``, ``QueueFullError``).
        """
        loop = asyncio.get_running_loop()

        def add() -> int | concurrent.futures.Future[int]:
            engine_prompt = prepare(prompt) if prepare is not None else prompt
            extra: dict[str, Any] = {"lora_request": lora_request} if lora_request is not None else {}
            if priority:  # engines without priority scheduling keep their signature
                extra["priority"] = priority
            n_prompt = self.engine.add_request(request_id, engine_prompt, params, **extra)
            self._tracked[request_id] = _Tracked(
                loop, out, arrival, num_choices, n=num_choices,
                max_tokens=getattr(params, "max_tokens", None),
            )
            if isinstance(n_prompt, concurrent.futures.Future):  # answered by a later step
                n_prompt.add_done_callback(lambda f: self._untrack_failed(request_id, f))
            return n_prompt

        n_prompt = await self.call(add)
        if isinstance(n_prompt, concurrent.futures.Future):
            n_prompt = await asyncio.wrap_future(n_prompt)
        return int(n_prompt)

    def _untrack_failed(self, request_id: str, answer: concurrent.futures.Future[int]) -> None:
        """A deferred add that failed never ran: stop tracking it (engine
        thread: the engine resolves its futures there)."""
        if answer.exception() is not None:
            self._tracked.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Abort a request (client gone); never blocks. Its blocks are freed
        before the next step runs."""

        def do_abort() -> None:
            tracked = self._tracked.pop(request_id, None)
            if tracked is None:
                return  # finished already, or never added
            if self.server_metrics is not None:
                self.server_metrics.finished("abort")
            self.engine.abort_request(request_id)

        self._submit(do_abort, None)

    async def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn()`` on the engine thread between steps and return its result."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._submit(fn, fut)
        wrapped = asyncio.wrap_future(fut)
        return await (asyncio.wait_for(wrapped, timeout) if timeout else wrapped)

    def metrics(self) -> dict[str, float]:
        """The engine's metrics as of the end of the last step (no waiting)."""
        return dict(self._snapshot)

    def _submit(self, fn: Callable[[], Any], fut: concurrent.futures.Future[Any] | None) -> None:
        with self._submit_lock:  # so no command slips in after _shutdown drained the queue
            if self._closed or not self.alive:
                raise EngineDeadError(
                    self.last_error or "the engine is not running (server shutting down)"
                )
            self._commands.put((fn, fut))
        self._wake.set()

    # --------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                ran = self._run_commands()
                if self.stats_logger is not None:
                    self.stats_logger.maybe_log(self._snapshot)
                if self.engine.has_unfinished():
                    self._step()
                elif not ran:
                    self._audit_if_due()
                    self._wake.wait(min(0.5, self.audit_interval_s or 0.5))
                    self._wake.clear()
        except BaseException as exc:  # a bug in this loop: fail loudly, not silently
            self.last_error = f"engine thread crashed: {type(exc).__name__}: {exc}"
            logger.exception("engine thread crashed")
            self._stopping.set()
        finally:
            self._shutdown()

    def _run_commands(self) -> bool:
        ran = False
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                if ran:
                    self._snapshot = dict(self.engine.metrics())
                return ran
            ran = True
            if fut is not None and not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except Exception as exc:
                if fut is not None:
                    fut.set_exception(exc)
                else:
                    logger.exception("engine command failed")
            else:
                if fut is not None:
                    fut.set_result(result)

    def _audit_if_due(self) -> None:
        """The periodic KV audit, run only while idle (it walks every block).
        Findings are logged and exported; reclaiming stays an operator action
        (``POST /admin/reclaim``)."""
        if not self.audit_interval_s or time.monotonic() - self._last_audit < self.audit_interval_s:
            return
        self._last_audit = time.monotonic()
        problems = self.engine.audit()
        if problems:
            logger.error(
                "KV block audit found %d problem(s): %s", len(problems), "; ".join(problems[:5])
            )
        self._snapshot = dict(self.engine.metrics())

    def _step(self) -> None:
        before = self._step_tokens()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self.step_errors += 1
            self.last_error = f"engine step failed: {type(exc).__name__}: {exc}"
            logger.error("%s\n%s", self.last_error, traceback.format_exc())
            self._end_all("error", self.last_error)
            if isinstance(exc, EngineFailedError):  # no later step can succeed
                self.last_error = str(exc)
                self._stopping.set()
            return
        self._route(outputs)
        self._snapshot = dict(self.engine.metrics())
        if self.server_metrics is not None and (tokens := self._step_tokens() - before) > 0:
            self.server_metrics.iteration_tokens.observe(tokens)

    def _step_tokens(self) -> float:
        """Prompt + generated tokens so far (their growth is one step's batch)."""
        m = self._snapshot
        return m.get("prompt_tokens_total", 0.0) + m.get("generation_tokens_total", 0.0)

    def _route(self, outputs: list[Any]) -> None:
        """Hand each tracked request's outputs of this step to its stream: one
        call per event loop for all of them (each hand-off wakes the loop's
        thread, which then holds the GIL while this thread waits to start the
        next step), and the latency histograms observed there, not here; then
        wait (``handoff_wait_s`` at most) until each loop has written them."""
        now = time.monotonic()
        by_request: dict[str, list[Any]] = {}
        for out in outputs:
            by_request.setdefault(out.request_id, []).append(out)
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[_Tracked, list[Any], bool]]] = {}
        for request_id, outs in by_request.items():
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue  # aborted while the step ran
            tracked.remaining -= sum(1 for out in outs if out.finished)
            done = tracked.remaining <= 0
            if done:
                del self._tracked[request_id]
            deliveries.setdefault(tracked.loop, []).append((tracked, outs, done))
        written: list[threading.Event] = []
        for loop, items in deliveries.items():
            ack = threading.Event()
            try:
                loop.call_soon_threadsafe(self._deliver_step, items, now, ack)
            except RuntimeError:  # the loop is closed: nobody listens
                continue
            written.append(ack)
        deadline = time.monotonic() + self.handoff_wait_s
        for ack in written:
            ack.wait(max(0.0, deadline - time.monotonic()))

    def _deliver_step(
        self, items: list[tuple[_Tracked, list[Any], bool]], now: float, written: threading.Event
    ) -> None:
        """On the event loop: observe one step's outputs (``now``: when the
        step ended), put each request's on its queue, and set ``written``
        once the streams this wakes have run (callbacks run in order: their
        wake-ups are queued before it), each up to its write."""
        for tracked, outs, done in items:
            for out in outs:
                self._observe(tracked, out, now)
            if done:
                if self.server_metrics is not None:  # one per request, as vLLM
                    self.server_metrics.finished(outs[-1].finish_reason or "stop")
                self._observe_finished(tracked, outs[-1], now)
            tracked.queue.put_nowait(outs)
        asyncio.get_running_loop().call_soon(written.set)

    def _observe(self, tracked: _Tracked, out: Any, now: float) -> None:
        n_new = len(out.new_token_ids)
        tracked.generated[out.index] = out.num_generated_tokens  # the engine's count
        if self.server_metrics is None or n_new == 0:
            return
        if tracked.first_token_at is None:
            tracked.first_token_at = now
            self.server_metrics.ttft.observe(now - tracked.arrival)
        last = tracked.last_token_at.get(out.index)
        if last is not None:
            gap = (now - last) / n_new
            for _ in range(n_new):
                self.server_metrics.itl.observe(gap)
        tracked.last_token_at[out.index] = now

    def _observe_finished(self, tracked: _Tracked, out: Any, now: float) -> None:
        """Per-request histograms, once all its choices finished (as vLLM:
        e2e latency, queue time, prompt and generation lengths, time per
        output token after the first)."""
        metrics = self.server_metrics
        if metrics is None:
            return
        metrics.e2e.observe(now - tracked.arrival)
        arrival, scheduled = getattr(out, "arrival_time", None), getattr(out, "first_scheduled_time", None)
        if arrival is not None and scheduled is not None:
            metrics.queue_time.observe(max(0.0, scheduled - arrival))
            metrics.inference_time.observe(max(0.0, now - scheduled))
            if tracked.first_token_at is not None:
                metrics.prefill_time.observe(max(0.0, tracked.first_token_at - scheduled))
        if tracked.first_token_at is not None:
            metrics.decode_time.observe(max(0.0, now - tracked.first_token_at))
        metrics.params_n.observe(tracked.n)
        if tracked.max_tokens is not None:
            metrics.params_max_tokens.observe(tracked.max_tokens)
        metrics.max_generation_tokens.observe(max(tracked.generated.values(), default=0))
        metrics.prompt_tokens.observe(out.num_prompt_tokens)
        metrics.generation_tokens.observe(sum(tracked.generated.values()))
        longest = max(tracked.generated.values(), default=0)
        if tracked.first_token_at is not None and longest > 1:
            metrics.tpot.observe((now - tracked.first_token_at) / (longest - 1))

    @staticmethod
    def _deliver(tracked: _Tracked, item: Any) -> None:
        # RuntimeError: the event loop is closed, nobody is listening any more
        with contextlib.suppress(RuntimeError):
            tracked.loop.call_soon_threadsafe(tracked.queue.put_nowait, item)

    def _end_all(self, reason: str, message: str) -> None:
        """Abort every tracked request in the engine and close its stream."""
        for request_id, tracked in list(self._tracked.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
            if self.server_metrics is not None:
                self.server_metrics.finished(reason)
            self._deliver(tracked, StreamEnd(reason, message))
        self._tracked.clear()

    def _shutdown(self) -> None:
        with self._submit_lock:
            self._closed = True
        self.aborted_at_shutdown = len(self._tracked)
        self._end_all("abort", "the server is shutting down")
        # Fail commands that arrived too late, so no caller waits forever.
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError("the server is shutting down"))
        # Let the engine release what aborted requests still hold.
        try:
            for _ in range(4):
                if not self.engine.has_unfinished():
                    break
                self.engine.step()
        except Exception:
            logger.exception("engine step during shutdown failed")
