"""A tensor- or pipeline-parallel worker process: ranks 1..N-1, one process each.

A worker process runs the same ``engine.worker.Worker`` as rank 0: it
joins the process groups, then makes every call rank 0 broadcasts
(``step_message.WorkerCall``: load its shard, calibrate, size and build its
KV cache, warm up, then one ``execute`` per step) until a stop message. It
never samples: with tensor parallelism only, the LM head's rows are rank
0's alone; the last pipeline stage computes the sampled rows' logits and
sends them to rank 0.

It exits when rank 0 goes: by the stop message, when rank 0's sockets close
(a collective then raises), or, as a last resort, when its parent process
is gone. Ctrl-C is left to rank 0, which stops the workers in order.

A pipe to rank 0 carries the start-up handshake (``STARTED`` once the
process runs our code, ``READY`` just before it joins the groups) and, if
the worker fails, its error's last traceback line: rank 0 waits on the pipe,
whose end also closes when the process dies, so it never waits on a worker
that is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from paged_server.config import RunConfig
from paged_server.parallel.process_groups import TPGroup
from paged_server.parallel.step_message import WorkerCall
from paged_server.platform import platform_for


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker process needs, picklable for ``spawn``."""

    rank: int
    world_size: int
    store_host: str
    store_port: int
    config: RunConfig  # the config as run (every rank runs the same)
    device: str  # "cpu" or "cuda:N"
    num_threads: int
    parent_pid: int
    micro_batches: int = 1  # pipeline parallelism: a step's micro-batches at most (pipeline.py)


STARTED, READY, ERROR = "started", "ready", "error"  # what a worker reports on its pipe


def parallel_kind(tp_size: int, pp_size: int) -> str:
    """What the ranks are, for messages: ``tensor-parallel``,
    ``pipeline-parallel``, or both."""
    if pp_size == 1:
        return "tensor-parallel"
    return "pipeline-parallel" if tp_size == 1 else "tensor- and pipeline-parallel"


def worker_main(spec: WorkerSpec, report: Connection) -> None:
    """Process entry point: run the worker; any error prints its traceback,
    sends its last line to rank 0 and exits with code 1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process; rank 0 decides
    _exit_with_parent(spec.parent_pid)
    try:
        report.send((STARTED, ""))
        run_worker(spec, ready=lambda: report.send((READY, "")))
    except BaseException as exc:
        kind = parallel_kind(spec.config.tensor_parallel_size, spec.config.pipeline_parallel_size)
        print(f"paged {kind} worker rank {spec.rank} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        with contextlib.suppress(OSError):  # OSError: rank 0 is gone
            # One short line, so the send cannot block on a full pipe.
            report.send((ERROR, traceback.format_exception_only(exc)[-1].strip()[:1000]))
        os._exit(1)


def run_worker(
    spec: WorkerSpec, ready: Callable[[], None] = lambda: None, store: dist.Store | None = None
) -> None:
    """Join the groups, then run rank 0's worker calls on this rank's
    ``Worker`` until stopped. ``ready`` runs once this process is set up,
    just before it joins; ``store``: the rendezvous store when the caller
    has opened it already (a rank on another node, see ``node_worker.py``)."""
    from paged_server.engine.worker.worker import Worker

    torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    platform_for(device).set_device(device)
    if store is None:
        store = dist.TCPStore(spec.store_host, spec.store_port, spec.world_size, False)
    ready()
    tp_size = spec.config.tensor_parallel_size
    group = TPGroup.connect(store, spec.rank, spec.world_size, device, tp_size=tp_size)
    worker = Worker(
        spec.config, rank=spec.rank, group=group, device=device,
        micro_batches=spec.micro_batches,
    )  # fmt: skip
    while True:
        call: WorkerCall = group.broadcast_message()
        if call.stop:
            return
        method = getattr(worker, call.method)
        if not call.handshake:  # a step: a failure is fatal for every rank anyway
            method(*call.args)
            continue
        try:
            method(*call.args)
        except BaseException:
            group.barrier_ok(False)  # rank 0 learns at once that this call failed here
            raise
        if not group.barrier_ok(True):  # another rank failed: rank 0 reports it and stops us
            return


def _exit_with_parent(parent_pid: int) -> None:
    """Exit when rank 0's process is gone (killed with no chance to stop us)."""

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="paged-tp-parent-watch", daemon=True).start()
