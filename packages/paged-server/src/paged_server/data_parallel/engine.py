"""`DataParallelEngine`: N engine replicas, one process each, as one `EngineLike`.

The API server drives it as it drives one `LLMEngine`, from its engine
thread (``openai/async_engine.py``): ``add_request`` picks a replica
(``balancer.py``), sends the request and returns a future of the replica's
answer, which a later ``step`` resolves: the prompt's token count, or what
that replica's engine raised (a bad request is still a 400, a full queue a
503). Not waiting there lets a burst of requests reach every replica before
its next step, as all reach one engine. ``step`` waits a few milliseconds
for any replica's outputs and returns them. Every replica steps on its own,
in parallel with the others (``replica.py``).

A replica that dies (its pipe closes) is drained: its in-flight requests
finish with ``finish_reason="error"`` and a message naming it and how it
died, and later requests go to the others. ``audit`` names it from then on,
so ``/health`` answers 503 while the others still serve (vLLM marks the
whole engine dead when one of its engine cores dies: an orchestrator
restarts the server to get the replica back). Only when every replica is
gone does ``step`` raise ``EngineFailedError``, which stops the server's
engine loop. Metrics are the replicas' summed (KV usage
weighted by capacity), plus ``dp_replica_<i>_<name>`` per replica.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import signal
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from paged_server.config import EngineConfig
from paged_server.data_parallel.balancer import Balancer, ReplicaLoad
from paged_server.data_parallel.replica import ReplicaInfo, replica_main
from paged_server.errors import EngineFailedError
from paged_server.outputs import RequestOutput

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # replicas import torch, load and (CPU) compile their model
STOP_TIMEOUT_S = 10.0
STEP_WAIT_S = 0.01  # how long step() waits for outputs: new requests wait at most this long
# Per-replica metrics exported with a replica label (the rest are summed).
PER_REPLICA = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
)


@dataclass(slots=True)
class _InFlight:
    replica: int
    choices: int
    num_prompt_tokens: int
    finished: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Adding:
    """A request sent to a replica that has not answered yet."""

    answer: concurrent.futures.Future[int]
    replica: int
    prompt: Any
    params: Any
    tokens: list[int]
    priority: int = 0


@dataclass(slots=True)
class _Replica:
    index: int
    process: Any
    conn: Connection
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    metrics: dict[str, float] = field(default_factory=dict)
    inflight: set[str] = field(default_factory=set)
    last_error: str | None = None  # a fatal step error it reported before exiting
    dead: str | None = None  # how it died, once it has


class DataParallelEngine:
    """``config.data_parallel_size`` replicas of ``LLMEngine(config)`` (see module doc)."""

    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        from paged_server.parallel import WorkerStartError
        from paged_server.parallel.rendezvous import torchrun_env
        from paged_server.platform import platform_for, usable_cpu_cores

        if (env := torchrun_env()) is not None and env.world_size > 1:
            raise ValueError(
                "data_parallel_size > 1 under torchrun: the replicas start their own ranks on "
                "this node; run `paged-server serve --data-parallel-size N` without torchrun"
            )
        from paged_server.engine.core.llm_engine import model_path
        from paged_server.models.loader import checkpoint_dtype, read_model_config

        n = config.data_parallel_size
        devices = replica_devices(config.device, n, config.world_size)
        # Resolved once, here: a bad path fails before any process starts, and
        # replicas never race to build or train the same default model.
        path = model_path(config)
        config.resolve(read_model_config(path), checkpoint_dtype=checkpoint_dtype(path))  # raises if bad
        threads = max(1, usable_cpu_cores() // n) if platform_for(devices[0]).ranks_share_host else 1
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        self._replicas: list[_Replica] = []
        self._inflight: dict[str, _InFlight] = {}
        self._adding: dict[str, _Adding] = {}  # sent, not answered yet
        self._pending: list[RequestOutput] = []  # outputs read while waiting for an answer
        self._call_ids = itertools.count()
        self._finalizer = weakref.finalize(self, _stop, self._replicas, 2.0)
        for i, device in enumerate(devices):
            replica_config = dataclasses.replace(config, data_parallel_size=1, device=device, model=path)
            mine, theirs = context.Pipe()
            # Not a daemon: a replica with tensor or pipeline parallelism starts
            # its ranks' processes, which daemons may not. It still never
            # outlives this process: it exits when its pipe closes.
            process = context.Process(
                target=replica_main, args=(i, replica_config, theirs, threads),
                name=f"paged-dp-replica{i}", daemon=False,
            )  # fmt: skip
            process.start()
            theirs.close()  # the replica holds the only other end: its exit closes the pipe
            self._replicas.append(_Replica(i, process, mine))
        try:
            infos = [self._await_ready(r) for r in self._replicas]
        except BaseException as exc:
            # Nothing to drain, and the others may still be loading (deaf to a
            # stop message until then): the one-line error is all that is said.
            _stop(self._replicas, 2.0, quiet=True)
            if isinstance(exc, RuntimeError):
                raise WorkerStartError(str(exc)) from exc
            raise
        first = infos[0]
        self.config = dataclasses.replace(first.config, data_parallel_size=n, model=config.model)
        self.capacity = first.capacity  # one replica's; metrics() sums them
        self.tokenizer = first.tokenizer
        self.default_sampling = first.default_sampling
        self.pooler = first.pooler  # the pooling API's, as an LLMEngine's
        self._replica_summary = first.parallel_summary
        for replica, info in zip(self._replicas, infos, strict=True):
            replica.metrics = dict(info.metrics)
        # Locality may pick a replica a little busier than the least-loaded one
        # (4 requests at the default 64 a batch): a hot prefix still spreads
        # over every replica, each then caching it, instead of piling onto one.
        self.balancer = Balancer(
            [r.load for r in self._replicas], self.config.block_size,
            slack=max(2, self.config.max_batch_size // 16),
        )  # fmt: skip

    # -- start-up -------------------------------------------------------------
    def _await_ready(self, replica: _Replica) -> ReplicaInfo:
        deadline = time.monotonic() + START_TIMEOUT_S
        name = f"data-parallel replica {replica.index} (pid {replica.process.pid})"
        while time.monotonic() < deadline:
            if not replica.conn.poll(1.0):
                continue
            try:
                kind, value = replica.conn.recv()
            except (EOFError, OSError):
                replica.process.join(5.0)  # its pipe closed: it is exiting
                raise RuntimeError(f"{name} {_exit_text(replica.process)} while starting") from None
            if kind == "ready":
                return value  # type: ignore[no-any-return]
            raise RuntimeError(f"{name} failed to start: {value}")
        raise RuntimeError(f"{name} did not start within {START_TIMEOUT_S:g} s")

    # -- EngineLike -------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: Any, params: Any, *, priority: int = 0
    ) -> concurrent.futures.Future[int]:
        """Send the request to the replica the balancer picks; returns a
        future of its prompt token count (or of what that replica's engine
        raised), resolved by a later ``step``."""
        if not self._live():
            raise EngineFailedError(self._all_dead())
        answer: concurrent.futures.Future[int] = concurrent.futures.Future()
        answer.set_running_or_notify_cancel()  # only an answer ends it, never a cancel
        tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._dispatch(request_id, _Adding(answer, -1, prompt, params, tokens, priority))
        return answer

    def _dispatch(self, request_id: str, adding: _Adding) -> None:
        """Send ``adding`` to the replica the balancer picks (any live one)."""
        while True:
            try:
                index, by_prefix = self.balancer.choose(adding.tokens)
            except RuntimeError:
                adding.answer.set_exception(EngineFailedError(self._all_dead()))
                return
            replica = self._replicas[index]
            message = ("add", request_id, adding.prompt, adding.params, adding.priority)
            if not self._send(replica, message):
                continue  # it died: try another
            adding.replica = index
            self._adding[request_id] = adding
            self.balancer.record(adding.tokens, index, by_prefix)
            self._inflight[request_id] = _InFlight(index, getattr(adding.params, "n", 1), len(adding.tokens))
            replica.inflight.add(request_id)
            self._update_load(replica)
            return

    def abort_request(self, request_id: str) -> None:
        """Abort on its replica (its last outputs, if any, come with a later step)."""
        flight = self._inflight.pop(request_id, None)
        if flight is None:
            return
        replica = self._replicas[flight.replica]
        replica.inflight.discard(request_id)
        self._update_load(replica)
        if replica.dead is None:
            self._send(replica, ("abort", request_id))

    def step(self) -> list[RequestOutput]:
        """Outputs any replica sent (waiting up to ``STEP_WAIT_S`` for some);
        error outputs for the requests of replicas that died."""
        live = self._live()
        if not live:
            if self._pending:
                return self._take()
            raise EngineFailedError(self._all_dead())
        if not self._pending:
            wait([r.conn for r in live], timeout=STEP_WAIT_S)
        for replica in live:
            self._drain(replica)
            if replica.dead is None and not replica.process.is_alive():
                self._drain(replica)  # what it sent before it died, then its pipe's end
                self._mark_dead(replica)  # a child of its own may still hold the pipe open
        return self._take()

    def has_unfinished(self) -> bool:
        """Requests in flight, outputs to hand over, or a replica with news
        (a message, or its pipe closed); always true once all are dead, so
        the next ``step`` reports it."""
        live = self._live()
        return bool(self._inflight or self._pending or not live or any(r.conn.poll() for r in live))

    def metrics(self) -> dict[str, float]:
        """The replicas' metrics summed (see module doc), and per replica."""
        return merge_metrics(
            [r.metrics for r in self._replicas],
            [r.dead is None for r in self._replicas],
            [r.load.routed for r in self._replicas],
            self.balancer.by_prefix,
        )

    def audit(self) -> list[str]:
        """Every dead replica (see module doc), and each live one's audit."""
        problems: list[str] = []
        for replica in self._live():  # a replica found dead here is named below
            found = self._call(replica, "audit")
            problems += [f"replica {replica.index}: {p}" for p in found or []]
        dead = [
            f"{r.dead}; the other replicas still serve, restart the server to get it back"
            for r in self._replicas
            if r.dead is not None
        ]
        return dead + problems

    def reclaim_leaked(self) -> list[int]:
        """Every live replica's reclaimed blocks (ids are per replica)."""
        return [b for r in self._live() for b in (self._call(r, "reclaim_leaked") or [])]

    def parallel_summary(self) -> str | None:
        pids = ", ".join(str(r.process.pid) for r in self._replicas)
        each = f"; each replica: {self._replica_summary}" if self._replica_summary else ""
        return (
            f"data_parallel_size={len(self._replicas)}: replicas (pids {pids}) of "
            f"{self.capacity.tokens} KV tokens each, balanced on load with prefix locality{each}"
        )

    def shutdown(self) -> None:
        """Stop every replica: a stop message, then (``STOP_TIMEOUT_S`` later) SIGKILL. Idempotent."""
        for replica in self._replicas:
            if replica.dead is None:
                self._send(replica, ("stop",))
        for adding in self._adding.values():
            adding.answer.set_exception(EngineFailedError("the server is shutting down"))
        self._adding.clear()
        _stop(self._replicas, STOP_TIMEOUT_S)
        for replica in self._replicas:
            replica.dead = replica.dead or "stopped"
            replica.load.alive = False

    @property
    def replica_pids(self) -> list[int]:
        return [r.process.pid for r in self._replicas]

    # -- internals ------------------------------------------------------------------
    def _live(self) -> list[_Replica]:
        return [r for r in self._replicas if r.dead is None]

    def _take(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        return outputs

    def _send(self, replica: _Replica, message: tuple[Any, ...]) -> bool:
        try:
            replica.conn.send(message)
        except (OSError, EOFError, ValueError):
            self._mark_dead(replica)
            return False
        return True

    def _await(self, replica: _Replica, match: Callable[[tuple[Any, ...]], bool]) -> tuple[Any, ...] | None:
        """Read ``replica``'s messages until one ``match``es (returned); the
        others are handled as ``step`` would. None: the replica died."""
        while replica.dead is None:
            if not replica.conn.poll(1.0):
                continue
            try:
                message = replica.conn.recv()
            except (EOFError, OSError):
                self._mark_dead(replica)
                return None
            if match(message):
                return message  # type: ignore[no-any-return]
            self._on_message(replica, message)
        return None

    def _call(self, replica: _Replica, name: str) -> Any:
        call_id = next(self._call_ids)
        if not self._send(replica, ("call", call_id, name)):
            return None
        reply = self._await(replica, lambda m: m[0] == "result" and m[1] == call_id)
        if reply is None:
            return None
        if reply[3] is not None:
            raise reply[3]
        return reply[2]

    def _drain(self, replica: _Replica) -> None:
        try:
            while replica.dead is None and replica.conn.poll():
                self._on_message(replica, replica.conn.recv())
        except (EOFError, OSError):
            self._mark_dead(replica)

    def _on_message(self, replica: _Replica, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "added":
            _, request_id, n_prompt = message
            if (flight := self._inflight.get(request_id)) is not None:
                flight.num_prompt_tokens = n_prompt
            if (adding := self._adding.pop(request_id, None)) is not None:
                adding.answer.set_result(n_prompt)
        elif kind == "add_failed":
            _, request_id, exc = message
            self._inflight.pop(request_id, None)
            replica.inflight.discard(request_id)
            self._update_load(replica)
            if (adding := self._adding.pop(request_id, None)) is not None:
                adding.answer.set_exception(exc)
        elif kind == "step":
            _, outputs, metrics = message
            replica.metrics = metrics
            for out in outputs:
                flight = self._inflight.get(out.request_id)
                if flight is None or not out.finished:
                    continue
                flight.finished.add(out.index)
                if len(flight.finished) >= flight.choices:
                    del self._inflight[out.request_id]
                    replica.inflight.discard(out.request_id)
            self._update_load(replica)
            self._pending.extend(outputs)
        elif kind == "step_failed":
            _, text, fatal = message
            if fatal:
                replica.last_error = text
            self._fail_requests(replica, f"data-parallel replica {replica.index}: {text}")
        else:
            log.error("unexpected message %r from data-parallel replica %d", kind, replica.index)

    def _update_load(self, replica: _Replica) -> None:
        """Load from what this side knows for sure (its requests in flight)
        split by the replica's last report (how many of them wait)."""
        inflight = len(replica.inflight)
        waiting = min(int(replica.metrics.get("num_requests_waiting", 0)), inflight)
        replica.load.waiting, replica.load.running = waiting, inflight - waiting
        replica.load.kv_usage = float(replica.metrics.get("kv_cache_usage_perc", 0.0))

    def _mark_dead(self, replica: _Replica) -> None:
        if replica.dead is not None:
            return
        replica.process.join(2.0)  # its pipe closed: it is exiting
        how = _exit_text(replica.process)
        if replica.last_error:
            how += f" ({replica.last_error})"
        replica.dead = f"data-parallel replica {replica.index} (pid {replica.process.pid}) {how}"
        replica.load.alive = False
        replica.metrics = {k: v for k, v in replica.metrics.items() if k.endswith("_total")}
        alive = len(self._live())
        log.error("%s; its requests failed, %d replica(s) go on", replica.dead, alive)
        # Requests it never answered for never ran: they go to another replica
        # (those aborted meanwhile only learn it died).
        resend = []
        for request_id, adding in list(self._adding.items()):
            if adding.replica != replica.index:
                continue
            del self._adding[request_id]
            if request_id in replica.inflight:
                replica.inflight.discard(request_id)
                self._inflight.pop(request_id, None)
                resend.append((request_id, adding))
            else:
                adding.answer.set_exception(EngineFailedError(replica.dead))
        self._fail_requests(replica, f"{replica.dead}; its requests failed, the other replicas go on")
        replica.conn.close()
        for request_id, adding in resend:
            self._dispatch(request_id, adding)

    def _fail_requests(self, replica: _Replica, message: str) -> None:
        """Finish every choice of ``replica``'s in-flight requests with an error."""
        for request_id in sorted(replica.inflight):
            flight = self._inflight.pop(request_id)
            for index in range(flight.choices):
                if index not in flight.finished:
                    self._pending.append(RequestOutput(
                        request_id, index, [], "", None, True, "error", message,
                        flight.num_prompt_tokens, 0,
                    ))  # fmt: skip
        replica.inflight.clear()
        self._update_load(replica)

    def _all_dead(self) -> str:
        return f"all {len(self._replicas)} data-parallel replicas are dead: " + "; ".join(
            r.dead or "?" for r in self._replicas
        )


def replica_devices(device: str, n: int, ranks: int = 1) -> list[str]:
    """Each replica's (first) device: the CPU for all, or ``ranks`` GPUs
    each (its tensor x pipeline ranks), in order from ``device``'s."""
    from paged_server.platform import platform_for, resolve_device

    first = resolve_device(device)
    platform = platform_for(first)
    platform.check_replicas(n, ranks, first)
    return [str(platform.rank_device(first, i * ranks)) for i in range(n)]


def merge_metrics(
    snapshots: list[dict[str, float]], alive: list[bool], routed: list[int], by_prefix: int
) -> dict[str, float]:
    """One engine's metrics from the replicas': counters summed over all
    (a dead replica's last count stays), gauges over the live ones, KV usage
    weighted by capacity; ``dp_replica_<i>_<key>`` per replica."""
    merged: dict[str, float] = {}
    keys = sorted({k for s in snapshots for k in s})
    live = [s for s, up in zip(snapshots, alive, strict=True) if up]
    for key in keys:
        if key.endswith("_total"):
            merged[key] = sum(s.get(key, 0.0) for s in snapshots)
        elif key == "kv_cache_usage_perc":
            blocks = [s.get("kv_capacity_blocks", 0.0) for s in live]
            used = sum(s.get(key, 0.0) * b for s, b in zip(live, blocks, strict=True))
            merged[key] = used / sum(blocks) if sum(blocks) else 0.0
        elif key == "kv_cache_groups":
            merged[key] = max((s.get(key, 1.0) for s in snapshots), default=1.0)
        else:
            merged[key] = sum(s.get(key, 0.0) for s in live)
    for i, snapshot in enumerate(snapshots):
        for key in PER_REPLICA:
            merged[f"dp_replica_{i}_{key}"] = snapshot.get(key, 0.0) if alive[i] or key.endswith("_total") else 0.0
        merged[f"dp_replica_{i}_requests_routed_total"] = float(routed[i])
        merged[f"dp_replica_{i}_alive"] = float(alive[i])
    merged["dp_replicas_alive"] = float(sum(alive))
    merged["dp_requests_routed_by_prefix_total"] = float(by_prefix)
    return merged


def _exit_text(process: Any) -> str:
    code = process.exitcode
    if code is None:
        return "closed its pipe"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _stop(replicas: list[_Replica], timeout: float, quiet: bool = False) -> None:
    """Close the replicas' pipes (each stops when it sees that), join them
    for up to ``timeout`` s (at least 2: they stop their own ranks), then
    SIGKILL what is left (replicas ignore SIGTERM, see replica.py), with a
    warning unless ``quiet``."""
    for replica in replicas:
        replica.conn.close()
    deadline = time.monotonic() + max(timeout, 2.0)
    for replica in replicas:
        replica.process.join(max(0.0, deadline - time.monotonic()))
    for replica in replicas:
        if replica.process.is_alive():
            if not quiet:
                log.warning("data-parallel replica %d did not stop: killing it", replica.index)
            replica.process.kill()
            replica.process.join(2.0)
