"""Where ranks on several nodes meet: torch.distributed's env:// rendezvous.

Every rank opens the same ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``, as
torch's ``env://`` does: rank 0 (the engine) hosts it, or, under
``torchrun``, its agent already does (``TORCHELASTIC_USE_AGENT_STORE``) and
every rank is a client. Rank 0 publishes the worker spec there, so a rank
on another node needs only the address and its rank, and each rank marks
itself joined, so rank 0 can name the ranks that never came.

Ranks are laid out node by node (torchrun's order): node ``r`` of
``nnodes`` runs ranks ``r * L .. r * L + L - 1`` with ``L = world / nnodes``.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

SPEC_KEY = "paged/spec"  # rank 0's WorkerSpec, pickled (see worker.py)
STOP_KEY = "paged/stop"  # set when rank 0 stops every rank (remote ranks watch it)
_JOINED = "paged/joined/"  # + rank: "host pid N" once that rank is up
_FAILED = "paged/failed/"  # + rank: its error line
_BEAT = "paged/beat/"  # + rank: a counter the rank's watcher thread bumps


@dataclass(frozen=True, slots=True)
class TorchrunEnv:
    """What ``torchrun`` (or any env:// launcher) tells this process."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def torchrun_env(environ: dict[str, str] | None = None) -> TorchrunEnv | None:
    """The env:// variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT), or None when RANK and WORLD_SIZE are not set."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        return TorchrunEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
        )
    except ValueError as exc:
        raise ValueError(f"torchrun environment: {exc} (RANK, WORLD_SIZE, LOCAL_RANK and "
                         "MASTER_PORT must be integers)") from None


def ranks_per_node(world_size: int, nnodes: int) -> int:
    """Ranks on each node; raise ``ValueError`` when they do not divide evenly."""
    if nnodes < 1 or world_size % nnodes:
        raise ValueError(
            f"tensor_parallel_size ({world_size}) must be a multiple of nnodes ({nnodes}): "
            "every node runs the same number of ranks"
        )
    return world_size // nnodes


def node_ranks(world_size: int, nnodes: int, node_rank: int) -> list[int]:
    """The ranks node ``node_rank`` runs."""
    per = ranks_per_node(world_size, nnodes)
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in 0..{nnodes - 1} for nnodes={nnodes}, got {node_rank}")
    return list(range(node_rank * per, (node_rank + 1) * per))


def agent_hosts_store() -> bool:
    """Whether torchrun's agent already hosts the store (then rank 0 is a client too)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def open_store(
    addr: str, port: int, world_size: int | None, is_master: bool, timeout_s: float
) -> dist.TCPStore:
    """A connection to the rendezvous store: ``is_master`` hosts it (port 0:
    any free one); a client waits up to ``timeout_s`` for it to listen.
    ``world_size``: None when a client does not know it yet. ``timeout_s``
    is also the store's timeout for every operation (a ``get`` waits that
    long for its key)."""
    try:
        if not is_master:
            _await_listening(addr, port, timeout_s)
        return dist.TCPStore(
            addr, port, world_size, is_master,
            timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
        )  # fmt: skip
    except (RuntimeError, OSError) as exc:
        where = "listen on" if is_master else "reach"
        raise RuntimeError(
            f"could not {where} the rendezvous store at {addr}:{port} "
            f"({str(exc).splitlines()[0][:200]}); check --master-addr/--master-port "
            "(the same on every node: an address of node 0, a port open between the nodes)"
        ) from exc


def _await_listening(addr: str, port: int, timeout_s: float) -> None:
    """Poll until ``addr:port`` accepts a connection. TCPStore's own client
    retries with exponential backoff (a node started a minute before the
    engine would join many seconds late) and logs a C++ stack per retry."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=2.0).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing listened there within {timeout_s:g} s ({exc})") from None
            time.sleep(0.2)


def publish_spec(store: dist.Store, spec: Any) -> None:
    store.set(SPEC_KEY, pickle.dumps(spec))


def read_spec(store: dist.Store) -> Any:
    """Rank 0's spec (blocks until it is published, up to the store's timeout).
    The store is trusted: it is the cluster's own, like every torch.distributed one."""
    return pickle.loads(store.get(SPEC_KEY))


def mark_joined(store: dist.Store, rank: int) -> None:
    store.set(f"{_JOINED}{rank}", f"{socket.gethostname()} pid {os.getpid()}")


def mark_failed(store: dist.Store, rank: int, error: str) -> None:
    store.set(f"{_FAILED}{rank}", error[:1000])


def failures(store: dist.Store, ranks: list[int]) -> dict[int, str]:
    """Error lines the given ranks have published."""
    found = {}
    for rank in ranks:
        if store.check([f"{_FAILED}{rank}"]):
            found[rank] = store.get(f"{_FAILED}{rank}").decode(errors="replace")
    return found


def heartbeat(store: dist.Store, rank: int) -> None:
    store.add(f"{_BEAT}{rank}", 1)


class HeartbeatWatch:
    """Rank 0's view of remote ranks' heartbeats: a rank whose count has not
    moved for a while is gone (counts, not timestamps: node clocks differ)."""

    def __init__(self, store: dist.Store, ranks: list[int]) -> None:
        self._store, self._ranks = store, ranks
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (count, when it last moved)

    def silent(self, stale_s: float) -> dict[int, float]:
        """``rank -> seconds`` for ranks silent at least ``stale_s`` since
        this watch first read them (so call it more than once)."""
        now, found = time.monotonic(), dict[int, float]()
        for rank in self._ranks:
            count = self._store.add(f"{_BEAT}{rank}", 0)
            seen, since = self._seen.get(rank, (-1, now))
            if count != seen:
                self._seen[rank] = (count, now)
            elif now - since >= stale_s:
                found[rank] = now - since
        return found


def await_ranks(
    store: dist.Store,
    ranks: list[int],
    nnodes: int,
    world_size: int,
    timeout_s: float,
    check: Callable[[], None] = lambda: None,
) -> None:
    """Wait until every rank in ``ranks`` has joined; raise ``TimeoutError``
    naming the missing ranks and their nodes, or ``RuntimeError`` with the
    error a rank published. ``check`` runs each poll (local workers' health)."""
    per = ranks_per_node(world_size, nnodes)
    deadline = time.monotonic() + timeout_s
    while True:
        check()
        if failed := failures(store, ranks):
            raise RuntimeError(
                "; ".join(f"rank {r} (node {r // per}) failed: {e}" for r, e in failed.items())
            )
        missing = [r for r in ranks if not store.check([f"{_JOINED}{r}"])]
        if not missing:
            return
        if time.monotonic() >= deadline:
            nodes = sorted({r // per for r in missing})
            raise TimeoutError(
                f"rank(s) {', '.join(map(str, missing))} on node(s) {', '.join(map(str, nodes))} "
                f"did not join within {timeout_s:g} s; start `paged-server worker --nnodes {nnodes} "
                f"--node-rank N --master-addr ADDR --master-port PORT` on each of those nodes "
                "(or torchrun there), with the address and port this engine listens on"
            )
        time.sleep(0.05)
