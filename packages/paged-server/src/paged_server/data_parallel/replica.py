"""One data-parallel replica: an `LLMEngine` in its own process, driven over a pipe.

The API server's `DataParallelEngine` sends commands; the replica answers
each at once between steps and, while it has work, steps and sends every
step's outputs with its metrics. A thread reads the pipe into a queue, so
the server's sends never wait on a step (and neither side can block the
other with a full pipe).

Messages to the replica (tuples, first item the kind):
``("add", request_id, prompt, params, priority)`` answered ``("added", request_id, n)``
or ``("add_failed", request_id, exc)``; ``("abort", request_id)``;
``("call", call_id, name)`` for ``audit`` / ``reclaim_leaked``, answered
``("result", call_id, value, exc)``; ``("stop",)``. From the replica:
``("ready", ReplicaInfo)`` or ``("start_failed", message)`` once, then
``("step", outputs, metrics)`` and ``("step_failed", message, fatal)``.

It stops on ``stop`` or when the pipe closes (the server is gone, even if
it was killed), and quietly when a send finds the pipe closed (the server
gave up on its start-up, or died). Signals are the server's to handle: the replica ignores
SIGINT and SIGTERM, so Ctrl-C in a terminal or systemd's SIGTERM to the
whole group lets the server drain its requests before it stops the replicas
(which it kills if they do not stop).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from paged_server import start_up_heap
from paged_server.config import EngineConfig
from paged_server.errors import EngineFailedError, ModelLoadError, describe_error

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """What the server needs from a replica once it has loaded its model."""

    config: Any  # the replica's RunConfig
    capacity: Any  # its PoolCapacity
    default_sampling: dict[str, Any]
    tokenizer: Any
    metrics: dict[str, float]
    parallel_summary: str | None  # its tensor/pipeline parallelism, if any
    pooler: Any = None  # a pooling model's PoolerConfig (--runner pooling), else None


def replica_main(index: int, config: EngineConfig, conn: Connection, num_threads: int) -> None:
    """The replica process's body (``spawn`` target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s replica{index} %(name)s: %(message)s")
    import torch

    torch.set_num_threads(num_threads)
    from paged_server.engine.core.llm_engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except BaseException as exc:
        if not isinstance(exc, (ModelLoadError, ValueError)):  # an operator's error is its line
            traceback.print_exc()
        with contextlib.suppress(OSError):  # the server may have stopped already
            conn.send(("start_failed", describe_error(exc)))
        return
    try:
        conn.send((
            "ready",
            ReplicaInfo(
                engine.config, engine.capacity, engine.default_sampling, engine.tokenizer,
                engine.metrics(), engine.parallel_summary(), engine.pooler,
            ),
        ))  # fmt: skip
        start_up_heap.freeze()  # the process lives as long as this engine
        inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        threading.Thread(target=_read, args=(conn, inbox), name="paged-dp-inbox", daemon=True).start()
        _serve(engine, conn, inbox)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server is gone (another replica failed to start, or it died): stop
    finally:
        engine.shutdown()
    # Skip the interpreter's teardown: torch's takes seconds in C, which only
    # delays the server's own exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _read(conn: Connection, inbox: queue.SimpleQueue[tuple[Any, ...]]) -> None:
    """Move every message from the pipe to ``inbox``; a closed pipe is a stop."""
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):
        inbox.put(("stop",))


def _serve(engine: Any, conn: Connection, inbox: queue.SimpleQueue[tuple[Any, ...]]) -> None:
    held: dict[str, int] = {}  # request -> choices not finished (failed together if a step fails)
    while True:
        try:  # idle: sleep until a message comes; busy: only take what is there
            message = inbox.get(block=not engine.has_unfinished())
        except queue.Empty:
            message = None
        while message is not None:
            if message[0] == "stop":
                return
            _handle(engine, conn, message, held)
            try:
                message = inbox.get_nowait()
            except queue.Empty:
                message = None
        if engine.has_unfinished():
            _step(engine, conn, held)


def _handle(engine: Any, conn: Connection, message: tuple[Any, ...], held: dict[str, int]) -> None:
    kind = message[0]
    if kind == "add":
        _, request_id, prompt, params, priority = message
        try:
            n = engine.add_request(request_id, prompt, params, priority=priority)
        except Exception as exc:  # ValueError, QueueFullError...: the client's answer
            conn.send(("add_failed", request_id, exc))
        else:
            held[request_id] = getattr(params, "n", 1)
            conn.send(("added", request_id, n))
    elif kind == "abort":
        held.pop(message[1], None)
        engine.abort_request(message[1])
    elif kind == "call":
        _, call_id, name = message
        try:
            value, error = getattr(engine, name)(), None
        except Exception as exc:
            value, error = None, exc
        conn.send(("result", call_id, value, error))
    else:
        log.error("unknown message %r", kind)


def _step(engine: Any, conn: Connection, held: dict[str, int]) -> None:
    try:
        outputs = engine.step()
    except Exception as exc:  # as AsyncEngine: fail what this replica holds, go on if it can
        fatal = isinstance(exc, EngineFailedError)
        message = str(exc) if fatal else f"engine step failed: {describe_error(exc)}"
        log.error("%s\n%s", message, traceback.format_exc())
        for request_id in held:
            engine.abort_request(request_id)
        held.clear()
        conn.send(("step_failed", message, fatal))
        if fatal:
            os._exit(1)
        return
    for out in outputs:
        if out.finished and out.request_id in held:
            held[out.request_id] -= 1
            if held[out.request_id] <= 0:
                del held[out.request_id]
    conn.send(("step", outputs, engine.metrics()))
