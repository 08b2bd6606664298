"""How the engine core reaches its workers: one call, run on every rank's worker.

An executor holds the driver worker (rank 0's, in the engine's own process)
and, with tensor or pipeline parallelism, the other ranks' processes
(``parallel/executor.py``). ``collective_rpc`` runs one ``Worker`` method on
every rank in the same order, as vLLM's ``collective_rpc`` and nano-vllm's
``ModelRunner.call`` do, and returns the driver's result; ``execute`` is the
per-step call. With one rank it is a plain method call (``UniProcExecutor``).
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from paged_server.engine.worker import Worker, WorkerStep


class Executor(Protocol):
    """What the engine core asks of its workers (see module doc)."""

    driver: Worker  # rank 0's worker, in this process
    world_size: int

    def collective_rpc(self, method: str, *args: Any, handshake: bool = False) -> Any:
        """Run ``Worker.<method>(*args)`` on every rank; the driver's result.
        ``handshake``: a start-up call every rank reports success of (a
        failure anywhere raises here, naming the rank)."""
        ...

    def execute(self, step: WorkerStep) -> Tensor | None:
        """One step on every rank; the driver's logits."""
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


class UniProcExecutor:
    """One rank: the driver worker, called directly."""

    world_size = 1

    def __init__(self, driver: Worker) -> None:
        self.driver = driver

    def collective_rpc(self, method: str, *args: Any, handshake: bool = False) -> Any:
        return getattr(self.driver, method)(*args)

    def execute(self, step: WorkerStep) -> Tensor | None:
        return self.driver.execute(step)

    def health(self) -> list[str]:
        return []

    def describe_failure(self, exc: BaseException) -> str:
        return f"{type(exc).__name__}: {exc}"

    def shutdown(self, reason: str | None = None) -> None:
        return None
