"""Ranks on another node: ``paged-server worker`` and ranks torchrun starts.

A rank here knows only the rendezvous address and its rank. It reads rank
0's spec from the store (model path, dtype, engine config: one source of
truth, so the nodes cannot disagree on them), marks itself joined, then runs
as any worker does (``worker.run_worker``). The model directory must exist
at the same path on every node.

It ends with the engine: by the stop message, when a collective finds rank
0's sockets closed, or, when the engine stopped without one (it failed), by
the stop key a watcher thread polls in the store; a store that stops
answering means rank 0 is gone, and the rank exits too. The same thread
bumps a heartbeat counter every 0.5 s: rank 0 has no pipe to a rank on
another node, and a silent counter is how its /health and a failed step's
error name the rank that is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp

from paged_server.parallel import rendezvous
from paged_server.parallel.worker import _exit_with_parent, run_worker
from paged_server.platform import platform_for, usable_cpu_cores

JOIN_TIMEOUT_S = 600.0  # a node may be started well before the engine loads
# A store that stops answering may be rank 0 exiting right after its stop
# message: the rank's own thread is then about to stop normally.
STOP_GRACE_S = 5.0


def run_rank(addr: str, port: int, rank: int, local_rank: int, local_ranks: int,
             timeout_s: float = JOIN_TIMEOUT_S) -> None:  # fmt: skip
    """Run rank ``rank`` of the engine whose store is at ``addr:port`` in this
    process; returns when the engine stops it. Raises on failure (after
    publishing its error line for rank 0)."""
    store = rendezvous.open_store(addr, port, None, False, timeout_s)
    spec = rendezvous.read_spec(store)
    if not 0 < rank < spec.world_size:
        raise ValueError(f"rank {rank} is not a worker rank of this engine "
                         f"(tensor_parallel_size={spec.world_size}: ranks 1..{spec.world_size - 1})")
    # this node's ``local_rank``-th GPU (the CPU for a CPU engine)
    kind = torch.device(spec.device).type
    device = str(platform_for(kind).rank_device(torch.device(kind), local_rank))
    spec = dataclasses.replace(
        spec, rank=rank, device=device, parent_pid=os.getppid(),
        num_threads=max(1, usable_cpu_cores() // local_ranks),
    )  # fmt: skip
    stopped = _exit_on_stop(addr, port, rank)
    try:
        run_worker(spec, ready=lambda: rendezvous.mark_joined(store, rank), store=store)
        stopped.set()  # by the stop message: the store may go before this process does
    except BaseException as exc:
        # this rank's failure decides its exit code: the watcher must not
        # exit 0 on the stop key rank 0 sets once it has read the error
        stopped.set()
        with contextlib.suppress(Exception):  # the store is gone with rank 0
            rendezvous.mark_failed(store, rank, traceback.format_exception_only(exc)[-1].strip())
        raise


def run_node(addr: str, port: int, nnodes: int, node_rank: int,
             timeout_s: float = JOIN_TIMEOUT_S) -> int:  # fmt: skip
    """``paged-server worker``: run node ``node_rank``'s ranks (one process
    each when there are several); the exit code is the worst of theirs."""
    store = rendezvous.open_store(addr, port, None, False, timeout_s)
    spec = rendezvous.read_spec(store)
    if spec.config.nnodes != nnodes:  # the ranks this node would run are another node's
        raise ValueError(f"--nnodes {nnodes} here, but the engine runs with --nnodes "
                         f"{spec.config.nnodes}; pass the same on every node")
    world = spec.world_size
    ranks = rendezvous.node_ranks(world, nnodes, node_rank)
    if 0 in ranks:
        raise ValueError("node 0 runs the engine (rank 0): start it with `paged-server serve` "
                         "or LLM(...) and --nnodes; `worker` is for --node-rank 1 and up")
    del store
    if len(ranks) == 1:
        run_rank(addr, port, ranks[0], 0, 1, timeout_s)
        return 0
    context = mp.get_context("spawn")
    procs = [
        context.Process(target=_rank_main, args=(addr, port, rank, i, len(ranks), timeout_s),
                        name=f"paged-node{node_rank}-rank{rank}", daemon=True)
        for i, rank in enumerate(ranks)
    ]  # fmt: skip
    for proc in procs:
        proc.start()

    def stop(signum: int, frame: Any) -> None:
        for proc in procs:
            proc.terminate()

    signal.signal(signal.SIGTERM, stop)
    for proc in procs:
        proc.join()
    return max(abs(proc.exitcode or 0) for proc in procs)


def _rank_main(addr: str, port: int, rank: int, local_rank: int, local_ranks: int,
               timeout_s: float) -> None:  # fmt: skip
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the node's process decides
    _exit_with_parent(os.getppid())
    try:
        run_rank(addr, port, rank, local_rank, local_ranks, timeout_s)
    except BaseException:
        print(f"paged worker rank {rank} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _exit_on_stop(addr: str, port: int, rank: int) -> threading.Event:
    """Beat for rank 0's health check, and exit once rank 0 sets the stop
    key or its store stops answering (a thread with its own connection: the
    rank's may be busy in a wait), unless the returned event is set first
    (the rank stopped normally; within ``STOP_GRACE_S`` of the store going,
    since rank 0 may exit right after its stop message)."""
    stopped = threading.Event()

    def watch() -> None:
        try:
            store = rendezvous.open_store(addr, port, None, False, 30.0)
            while not store.check([rendezvous.STOP_KEY]):
                rendezvous.heartbeat(store, rank)
                if stopped.wait(0.5):
                    return
            code = 0
        except Exception:
            code = 1  # rank 0 is gone: crashed, or stopped us and exited
            if stopped.wait(STOP_GRACE_S):
                return
        if not stopped.is_set():
            sys.stderr.flush()
            os._exit(code)

    threading.Thread(target=watch, name="paged-stop-watch", daemon=True).start()
    return stopped
