"""Several ranks, one engine: start the other ranks' workers, call them, stop them.

The engine process is rank 0: its engine core keeps the scheduler and the
KV cache manager, and its own ``Worker`` (the driver) runs its shard of
each step. ``MultiprocExecutor`` spawns ranks 1..N-1 (``torch.multiprocessing``,
spawn), joins the process groups with them, and from then on every worker
call goes to every rank: ``collective_rpc`` broadcasts it
(``step_message.WorkerCall``), then makes it on the driver, so every rank
runs the same code in the same order and the layers' all-reduces meet.
With pipeline parallelism the ranks form ``pipeline_parallel_size`` stages
of ``tensor_parallel_size`` ranks (rank 0 and its stage first); each runs its
stage of the step (``pipeline.py``, in micro-batches so the stages
overlap) and the last returns the logits.

Start-up checks the size first (``preflight``), then waits on each worker's
pipe until it is ready to join the groups: a worker that fails or dies
before that (an import error, a bad device, a main module spawn cannot
import) ends start-up at once with its error, and every worker is stopped.
Each start-up call (load, calibrate, size, build, warm up) ends with every
rank reporting success; a failure anywhere ends start-up with its error.

On several nodes (``nnodes > 1``, or under torchrun) the store listens on
``master_addr:master_port`` instead of loopback; this process spawns only
node 0's ranks, publishes the worker spec in the store for the other nodes'
ranks (``node_worker.py``), and waits for them with a timeout that names
the ranks that never joined (``rendezvous.py``).

Failure is all-or-nothing: once a rank dies or a collective fails the ranks
can no longer agree on what their KV caches hold, so the engine stops all
of them and reports which rank died and how.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import Tensor

from paged_server.config import EngineConfig, RunConfig
from paged_server.engine.core.executor import LaunchesOnThread, LaunchThread
from paged_server.engine.worker.worker import Worker, WorkerStep
from paged_server.errors import WorkerStartError
from paged_server.parallel import rendezvous
from paged_server.parallel.pipeline import micro_batch_count
from paged_server.parallel.preflight import (
    GUARD_HINT,
    check_tensor_parallel,
    main_module_imported_by_spawn,
)
from paged_server.parallel.process_groups import TPGroup
from paged_server.parallel.step_message import WorkerCall
from paged_server.parallel.worker import ERROR, READY, WorkerSpec, parallel_kind, worker_main
from paged_server.platform import platform_for, usable_cpu_cores

log = logging.getLogger(__name__)

STORE_HOST = "127.0.0.1"  # one machine; master_addr for several
START_TIMEOUT_S = 300.0  # workers import torch and load their shard first
STOP_TIMEOUT_S = 10.0
# A rank on another node beats every 0.5 s (node_worker.py); this long a
# silence means it is gone (it has no pipe, no exit code rank 0 can see).
HEARTBEAT_STALE_S = 5.0


class MultiprocExecutor(LaunchesOnThread):
    """The driver worker here and ranks 1..N-1 of ``config.world_size`` in
    processes of their own (see module doc); started by the constructor
    (on the checkpoint at ``path``, checked first)."""

    def __init__(self, config: RunConfig, path: str) -> None:
        device = config.torch_device
        world = config.world_size
        self.world_size = world
        self.tp_size = config.tensor_parallel_size
        self.pp_size = config.pipeline_parallel_size
        self.kind = parallel_kind(self.tp_size, self.pp_size)  # how messages name the ranks
        self.config = config
        self.micro_batches = micro_batch_count(self.pp_size) if self.pp_size > 1 else 1
        addr, port, is_master, local, per_node = _layout(config)
        self._local = local  # ranks 0..local-1 run on this node, spawned here
        self._remote = list(range(local, world))  # started on other nodes (or by torchrun)
        self._nnodes = world // per_node
        self.platform = platform_for(device)
        self.device = self.platform.rank_device(device, 0)
        self.platform.set_device(self.device)
        # On CPU the ranks share the cores instead of each taking all of them
        # (restored at shutdown: the setting is process-wide). With one
        # micro-batch per step only one pipeline stage computes at a time, so
        # a stage's ranks share them; with several, every stage computes at once.
        self._threads = torch.get_num_threads()
        if self.platform.ranks_share_host:
            busy = local if self.micro_batches > 1 else min(local, self.tp_size)
            torch.set_num_threads(max(1, usable_cpu_cores() // busy))
        self.dead: str | None = None  # why the ranks stopped, once they have
        try:
            store = rendezvous.open_store(addr, port, world, is_master, START_TIMEOUT_S)
        except RuntimeError as exc:
            raise WorkerStartError(str(exc)) from exc
        self._store = store
        base = WorkerSpec(
            rank=0,
            world_size=world,
            store_host=addr,
            store_port=port or store.port,  # port 0: the one the store picked
            config=config,
            device=str(device),
            num_threads=torch.get_num_threads(),
            parent_pid=os.getpid(),
            micro_batches=self.micro_batches,
        )
        self._specs = [
            dataclasses.replace(base, rank=rank, device=str(self.platform.rank_device(device, rank)))
            for rank in range(0, local)
        ]
        self.workers: list[Any] = []  # multiprocessing processes, ranks 1..N-1
        self._reports: list[Connection] = []  # each worker's pipe (see worker.py)
        self._last: list[str] = []  # what each worker last reported on it
        self._errors: list[str] = []  # each worker's error line, once it sent one
        self.group: TPGroup | None = None
        self._beats = rendezvous.HeartbeatWatch(store, self._remote)
        # Workers never outlive this object, nor the interpreter (atexit).
        self._finalizer = weakref.finalize(self, _stop_processes, self.workers, STOP_TIMEOUT_S)
        self.launcher = LaunchThread(self.device)
        self.driver: Worker
        check_tensor_parallel(  # before any process starts
            self.tp_size, path, self.device, self._local, pipeline_parallel_size=self.pp_size
        )
        try:
            self._start()
        except BaseException:
            self.shutdown(f"{self.kind} start-up failed")  # no worker outlives a failed start
            raise

    # -- start-up -------------------------------------------------------------
    def _start(self) -> None:
        """Spawn this node's workers, wait until every rank is ready, join
        the groups; the driver worker is rank 0's ``Worker``."""
        context = mp.get_context("spawn")
        if self._remote:  # what the other nodes' ranks read (rank 0's spec: theirs but rank, device)
            rendezvous.publish_spec(self._store, self._specs[0])
        for spec in self._specs[1:]:
            reader, writer = context.Pipe(duplex=False)
            name = f"paged-tp-rank{spec.rank}"
            process = context.Process(target=worker_main, args=(spec, writer), name=name, daemon=True)
            process.start()
            writer.close()  # the worker holds the only write end: its exit closes the pipe
            self.workers.append(process)
            self._reports.append(reader)
            self._last.append("")
            self._errors.append("")
        self._await_ready()
        self._await_remote()
        try:
            self.group = TPGroup.connect(
                self._store, 0, self.world_size, self.device, tp_size=self.tp_size
            )
        except Exception as exc:
            raise WorkerStartError(
                f"{self.kind} workers did not join: {self._worker_status(wait_s=5.0) or exc}"
            ) from exc
        self.driver = Worker(
            self.config, rank=0, group=self.group, device=self.device, micro_batches=self.micro_batches
        )

    # -- the calls ---------------------------------------------------------------
    def collective_rpc(self, method: str, *args: Any, handshake: bool = False) -> Any:
        """``Worker.<method>(*args)`` on every rank (see module doc); the
        driver's result. With ``handshake`` (start-up) every rank reports
        whether it succeeded, and a failure anywhere raises
        ``WorkerStartError`` with that rank's error."""
        group = self._require_group()
        if not handshake:
            self._check_alive()
            group.broadcast_message(WorkerCall(method, args))
            return getattr(self.driver, method)(*args)
        what = method.replace("_", " ")
        try:
            group.broadcast_message(WorkerCall(method, args, handshake=True))
        except Exception as exc:
            raise WorkerStartError(
                f"a {self.kind} worker died before {what}: {self._worker_status(wait_s=5.0) or exc}"
            ) from exc
        result, ok = None, False
        try:
            result = getattr(self.driver, method)(*args)
            ok = True
        finally:
            try:
                all_ok = group.barrier_ok(ok)
            except Exception as exc:
                raise WorkerStartError(
                    f"a {self.kind} worker died during {what}: {self._worker_status(wait_s=5.0) or exc}"
                ) from exc
        if not all_ok:
            self._await_remote_failure(wait_s=5.0)  # a remote rank publishes its error after the barrier
            raise WorkerStartError(
                f"a {self.kind} worker failed during {what}: "
                + (self._worker_status(wait_s=STOP_TIMEOUT_S) or "its traceback is above")
            )
        return result

    def execute(self, step: WorkerStep, meta: Any = None) -> Tensor | None:
        """One step on every rank (the message first, then the driver's pass;
        ``meta``: the driver's metadata, built ahead: never sent). ``launch``
        runs it on the launch thread, so the message goes from there too."""
        self._check_alive()
        self._require_group().broadcast_message(WorkerCall("execute", (step,)))
        return self.driver.execute(step, meta)

    def _await_ready(self) -> None:
        """Wait until every worker is about to join the groups; raise
        ``WorkerStartError`` as soon as one fails or exits instead."""
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = set(range(len(self.workers)))
        while waiting:
            pipes = [self._reports[i] for i in waiting]
            if not wait(pipes, timeout=max(0.0, deadline - time.monotonic())):
                raise WorkerStartError(
                    f"{self.kind} workers did not start within {START_TIMEOUT_S:g} s"
                )
            for i in list(waiting):
                self._read_reports(i)
                if self._last[i] == READY:
                    waiting.discard(i)
                elif self._errors[i] or self._reports[i].closed:
                    raise WorkerStartError(self._worker_status(wait_s=5.0))

    def _await_remote(self) -> None:
        """Wait until every rank on another node has joined the store."""
        if not self._remote:
            return

        def local_workers_alive() -> None:
            if status := self._worker_status(wait_s=1.0, remote=False):
                raise WorkerStartError(status)

        try:
            rendezvous.await_ranks(
                self._store, self._remote, self._nnodes, self.world_size, START_TIMEOUT_S,
                check=local_workers_alive,
            )  # fmt: skip
        except (TimeoutError, RuntimeError) as exc:
            if isinstance(exc, WorkerStartError):
                raise
            raise WorkerStartError(f"{self.kind} start-up: {exc}") from exc

    def _await_remote_failure(self, wait_s: float) -> None:
        """Give a failing rank on another node ``wait_s`` to publish its error."""
        deadline = time.monotonic() + wait_s
        while self._remote and time.monotonic() < deadline:
            try:
                if rendezvous.failures(self._store, self._remote):
                    return
            except Exception:
                return
            time.sleep(0.05)

    def _read_reports(self, i: int) -> None:
        """Take what worker ``i`` has sent so far (closing its pipe at its end)."""
        pipe = self._reports[i]
        while not pipe.closed and pipe.poll():
            try:
                kind, text = pipe.recv()
            except (EOFError, OSError):
                pipe.close()
                return
            self._last[i] = kind
            if kind == ERROR:
                self._errors[i] = text

    def describe_failure(self, exc: BaseException) -> str:
        """Why a step failed, naming a dead worker when there is one."""
        for process in self.workers:
            process.join(1.0)  # a rank whose sockets closed is exiting
            if process.exitcode is not None:
                break
        status = self._worker_status()
        deadline = time.monotonic() + 2.0
        while not status and self._remote and time.monotonic() < deadline:
            time.sleep(0.1)  # a dead remote rank shows as a heartbeat that stops
            status = self._worker_status(stale_s=1.5)
        if status:
            return status
        return (
            f"a collective or the forward pass failed on rank 0 ({type(exc).__name__}: {exc}); "
            "the ranks can no longer agree, so all were stopped"
        )

    def health(self) -> list[str]:
        """Problems with the workers (empty when every one is running)."""
        status = self.dead or self._worker_status(stale_s=HEARTBEAT_STALE_S)
        return [status] if status else []

    # -- shutdown -----------------------------------------------------------------
    def shutdown(self, reason: str | None = None) -> None:
        """Stop every worker: a stop message when they are healthy, else
        SIGTERM then SIGKILL. Idempotent."""
        if reason is None:  # a step still running on the launch thread finishes first
            self.launcher.close()
        healthy = (
            reason is None
            and self.group is not None
            and self.dead is None
            and not self._worker_status(remote=False)
        )
        if healthy:
            try:
                self._require_group().broadcast_message(WorkerCall(stop=True))
            except Exception:
                log.warning("could not send the stop message to the %s workers", self.kind)
                healthy = False
        self.dead = self.dead or reason or "the engine was shut down"
        if not healthy:  # a worker may be stuck in a collective: no grace period
            _stop_processes(self.workers, 0.0)
        if self._remote:  # other nodes' ranks watch this key (they may be stuck in a collective)
            try:
                self._store.set(rendezvous.STOP_KEY, "1")
            except Exception:
                log.warning("could not tell the other nodes' ranks to stop (the store is gone)")
        self._finalizer()  # joins, then terminates and kills what is left
        torch.set_num_threads(self._threads)

    # -- internals -----------------------------------------------------------------
    def _check_alive(self) -> None:
        """Raise if a rank is gone (its pipe or exit code says so: no store trip per step)."""
        if self.dead is None and (status := self._worker_status(remote=False)):
            self.dead = status
        if self.dead is not None:
            raise RuntimeError(self.dead)

    def _require_group(self) -> TPGroup:
        if self.group is None:
            raise RuntimeError(f"{self.kind} workers are not started")
        return self.group

    def _worker_status(
        self, wait_s: float = 0.0, remote: bool = True, stale_s: float | None = None
    ) -> str:
        """Which workers have failed or exited, how, and their error line
        ("" when all run). ``wait_s``: how long to give a worker whose pipe
        says it is going to finish exiting; ``remote``: also the errors ranks on
        other nodes published; ``stale_s``: also those silent that long."""
        dead = []
        for i, process in enumerate(self.workers):
            self._read_reports(i)
            if self._errors[i] or self._reports[i].closed:
                process.join(wait_s)
            code = getattr(process, "exitcode", None)
            if code in (None, 0) and not self._errors[i]:
                continue  # running, or stopped because another rank failed
            if code is None:
                how = "failed"
            elif code < 0:
                how = f"killed by {signal.Signals(-code).name}"
            else:
                how = f"exited with code {code}"
            if self._errors[i]:
                how += f": {self._errors[i]}"
            elif not self._last[i] and code is not None and code > 0:
                how += " before it started, while spawn imported the main module again or ours"
                if main_module_imported_by_spawn():  # which runs the module's top level again
                    how += f"; {GUARD_HINT}"
            dead.append(f"{self.kind} worker {process.name} (pid {process.pid}) {how}")
        if self._remote and remote:
            dead += self._remote_status(stale_s)
        if not dead:
            return ""
        where = "this process's stderr" + (", or its node's" if self._remote else "")
        return "; ".join(dead) + f" (a worker's traceback, if it raised, is in {where})"


    def _remote_status(self, stale_s: float | None) -> list[str]:
        """What is wrong with the ranks on other nodes: their published errors,
        and (``stale_s``) heartbeats that have not moved for that long."""
        per_node = self.world_size // self._nnodes
        try:
            failed = rendezvous.failures(self._store, self._remote)
            silent = self._beats.silent(stale_s) if stale_s is not None else {}
        except Exception as exc:  # our own store: only a broken process gets here
            return [f"the rendezvous store failed ({exc})"]
        found = [f"{self.kind} rank {r} (node {r // per_node}) failed: {e}" for r, e in failed.items()]
        found += [
            f"{self.kind} rank {r} (node {r // per_node}) stopped responding "
            f"(no heartbeat for {s:.0f} s: its process or node is gone)"
            for r, s in silent.items() if r not in failed
        ]  # fmt: skip
        return found


def _layout(config: EngineConfig) -> tuple[str, int, bool, int, int]:
    """(store address, port, whether this process hosts the store, ranks
    spawned here, ranks per node) for one node, ``nnodes`` or torchrun."""
    world = config.world_size
    env = rendezvous.torchrun_env()
    if env is not None and env.world_size > 1:  # torchrun started every rank
        if env.rank != 0:
            raise ValueError(
                f"this process is rank {env.rank} under torchrun: the engine is rank 0; run "
                "`paged-server worker` (or `serve`, which becomes one) on the other ranks"
            )
        if env.world_size != world:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size ({world}) must equal torchrun's "
                f"WORLD_SIZE ({env.world_size}): every rank torchrun starts is one engine rank"
            )
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        is_master = not rendezvous.agent_hosts_store()
        return env.master_addr, env.master_port, is_master, 1, per_node
    if config.nnodes > 1:
        per_node = rendezvous.ranks_per_node(world, config.nnodes)
        return config.master_addr, config.master_port, True, per_node, per_node
    return STORE_HOST, 0, True, world, world


def _stop_processes(processes: list[Any], timeout: float) -> None:
    """Join ``processes`` for up to ``timeout`` s, then SIGTERM, then SIGKILL."""
    for process in processes:
        process.join(timeout)
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join(2.0)


