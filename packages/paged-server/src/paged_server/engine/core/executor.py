"""How the engine core reaches its workers: one call, run on every rank's worker.

An executor holds the driver worker (rank 0's, in the engine's own process)
and, with tensor or pipeline parallelism, the other ranks' processes
(``parallel/executor.py``). ``collective_rpc`` runs one ``Worker`` method on
every rank in the same order, as vLLM's ``collective_rpc`` and nano-vllm's
``ModelRunner.call`` do, and returns the driver's result; ``execute`` is the
per-step call. With one rank it is a plain method call (``UniProcExecutor``).

``launch`` runs ``execute`` on a thread of its own (``LaunchThread``), as a
device stream runs work the host queued: with ``--async-scheduling`` the
engine core plans the next step and makes the last step's outputs while a
step runs there, and waits for it only when it needs its logits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch
from torch import Tensor

from paged_server.engine.worker.worker import Worker, WorkerStep
from paged_server.platform import platform_for


class Executor(Protocol):
    """What the engine core asks of its workers (see module doc)."""

    driver: Worker  # rank 0's worker, in this process
    world_size: int

    def collective_rpc(self, method: str, *args: Any, handshake: bool = False) -> Any:
        """Run ``Worker.<method>(*args)`` on every rank; the driver's result.
        ``handshake``: a start-up call every rank reports success of (a
        failure anywhere raises here, naming the rank)."""
        ...

    def execute(self, step: WorkerStep, meta: Any = None) -> Tensor | None:
        """One step on every rank; the driver's logits (``meta``: the driver's
        metadata for it, built ahead)."""
        ...

    def launch(
        self, step: WorkerStep, then: Callable[[Tensor | None], Any] | None = None, meta: Any = None,
        before: Callable[[WorkerStep], None] | None = None,
    ) -> Future[Any]:
        """``execute`` on the launch thread after the steps launched before
        it: ``before(step)`` first there (its token ids from the step before's
        samples), then ``then`` of its result (work that belongs beside the
        pass, as a device kernel would). Returns at once."""
        ...

    def health(self) -> list[str]:
        """Problems with the other ranks (empty when all run)."""
        ...

    def describe_failure(self, exc: BaseException) -> str:
        """Why a step failed, naming a dead rank when there is one."""
        ...

    def shutdown(self, reason: str | None = None) -> None:
        """Stop the other ranks (idempotent)."""
        ...


# How long ``submit`` waits for the launch thread to start a step at most
# (longer only while an earlier step still runs there).
START_WAIT_S = 0.05


class LaunchThread:
    """One thread that runs the steps it is given in order (made on first
    use; on CUDA it works on the driver's device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: ThreadPoolExecutor | None = None
        self._queued = 0  # steps submitted and not done
        self._lock = threading.Lock()

    def submit(
        self, execute: Callable[[WorkerStep, Any], Tensor | None], step: WorkerStep,
        then: Callable[[Tensor | None], Any] | None = None, meta: Any = None,
        before: Callable[[WorkerStep], None] | None = None,
    ) -> Future[Any]:  # fmt: skip
        """Run ``before(step)``, ``execute(step, meta)``, then ``then`` of its
        result there. When nothing else is queued it returns once the step
        has started, so the launch goes first (waiting hands the launch
        thread the GIL at once, where the caller's next Python would hold it
        for up to a switch interval, 5 ms)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, "paged-launch", initializer=self._on_thread)
        started = threading.Event()

        def run() -> Any:
            started.set()
            try:
                if before is not None:
                    before(step)
                out = execute(step, meta)
                return out if then is None else then(out)
            finally:
                with self._lock:
                    self._queued -= 1

        with self._lock:
            idle = self._queued == 0
            self._queued += 1
        future = self._pool.submit(run)
        if idle:
            started.wait(START_WAIT_S)
        return future

    def close(self) -> None:
        """Wait for what was submitted, then end the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _on_thread(self) -> None:
        platform_for(self.device).set_device(self.device)


class LaunchesOnThread:
    """``Executor.launch`` for an executor that holds a ``LaunchThread`` as
    ``launcher``: its own ``execute``, run on that thread."""

    launcher: LaunchThread

    def execute(self, step: WorkerStep, meta: Any = None) -> Tensor | None:
        raise NotImplementedError

    def launch(
        self, step: WorkerStep, then: Callable[[Tensor | None], Any] | None = None, meta: Any = None,
        before: Callable[[WorkerStep], None] | None = None,
    ) -> Future[Any]:
        """``execute`` on the launch thread (see ``Executor.launch``)."""
        return self.launcher.submit(self.execute, step, then, meta, before)


class UniProcExecutor(LaunchesOnThread):
    """One rank: the driver worker, called directly."""

    world_size = 1

    def __init__(self, driver: Worker) -> None:
        self.driver = driver
        self.launcher = LaunchThread(driver.device)

    def collective_rpc(self, method: str, *args: Any, handshake: bool = False) -> Any:
        return getattr(self.driver, method)(*args)

    def execute(self, step: WorkerStep, meta: Any = None) -> Tensor | None:
        return self.driver.execute(step, meta)

    def health(self) -> list[str]:
        return []

    def describe_failure(self, exc: BaseException) -> str:
        return f"{type(exc).__name__}: {exc}"

    def shutdown(self, reason: str | None = None) -> None:
        self.launcher.close()
