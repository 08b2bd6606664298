"""A tensor- or pipeline-parallel worker: ranks 1..N-1, one process each.

A worker loads its shard of the model (only its slices of the checkpoint;
with pipeline parallelism only its stage's layers), builds a KV pool for
its heads (and its stage's layers) with the same blocks as rank 0's,
reports ready, then runs what rank 0 broadcasts, one forward pass per
message, until a stop message. It never samples: with tensor parallelism
only, the LM head's rows are rank 0's alone; the last pipeline stage
computes the sampled rows' logits and sends them to rank 0.

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
from typing import Any, cast

import torch
import torch.distributed as dist

from paged_server.config import EngineConfig
from paged_server.parallel.process_groups import TPGroup
from paged_server.parallel.step_message import StepMessage


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker process needs, picklable for ``spawn``."""

    rank: int
    world_size: int
    store_host: str
    store_port: int
    config: EngineConfig
    model_path: str
    dtype: str  # a torch dtype name: "float32", "bfloat16"...
    device: str  # "cpu" or "cuda:N"
    attention_backend: str
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
    """Join the groups, load the shard, then execute steps until stopped.
    ``ready`` runs once this process is set up, just before it joins;
    ``store``: the rendezvous store when the caller has opened it already
    (a rank on another node, see ``node_worker.py``)."""
    from paged_ref.attention_metadata import build_metadata
    from paged_ref.cache_view import CacheView, ViewPool
    from paged_ref.kv_quant import scale_keywords
    from paged_server.engine.pool_factory import build_cache_pool
    from paged_server.models import load_model
    from paged_server.models.pipeline_parallel import PipelineStage
    from paged_server.models.tensor_parallel import TensorParallel, shard_heads
    from paged_server.parallel.pipeline import PipelineStep

    torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if store is None:
        store = dist.TCPStore(spec.store_host, spec.store_port, spec.world_size, False)
    ready()
    tp_size = spec.config.tensor_parallel_size
    group = TPGroup.connect(store, spec.rank, spec.world_size, device, tp_size=tp_size)
    tp = TensorParallel(spec.rank % tp_size, tp_size, group)
    stage = PipelineStage(spec.rank // tp_size, spec.config.pipeline_parallel_size)
    try:
        loaded = load_model(
            spec.model_path, getattr(torch, spec.dtype), device, tp, spec.config.quantization,
            pp=stage,
        )  # fmt: skip
        mc = loaded.config
        heads = shard_heads(mc.num_heads, mc.num_kv_heads, tp)
        pool, _ = build_cache_pool(
            spec.config, mc, loaded.dtype, device, spec.attention_backend,
            num_kv_heads=heads.num_kv_heads, pp=loaded.model.pp,
        )  # fmt: skip
    except BaseException:
        group.barrier_ok(False)  # rank 0 learns at once that start-up failed
        raise
    if not group.barrier_ok(True):  # another rank failed to start: rank 0 reports it
        return
    view_pool = cast(ViewPool, pool)
    paged = spec.config.kv_cache_backend == "paged"
    block_size = spec.config.block_size if paged else spec.config.max_model_len
    model: Any = loaded.model
    pipeline = None
    if stage.size > 1:
        pipeline = PipelineStep(model, group, loaded.dtype, device, block_size, spec.micro_batches)
    while True:
        message: StepMessage = group.broadcast_message()
        if message.stop:
            return
        with torch.inference_mode():
            for pairs in message.copies:
                view_pool.ops.copy_blocks(
                    view_pool.k_cache, view_pool.v_cache, pairs,
                    **scale_keywords(view_pool.k_scales, view_pool.v_scales),
                )  # fmt: skip
            assert message.block_tables is not None
            meta = build_metadata(
                torch.from_numpy(message.block_tables), message.starts, message.new_lens,
                block_size, device,
            )  # fmt: skip
            ids = torch.tensor(message.input_ids, dtype=torch.long, device=device)
            view = CacheView.over(view_pool, meta)
            if pipeline is not None:
                pipeline.run(ids, view, message.rows)
            else:
                model.hidden_states(ids, meta.positions, view)


def _exit_with_parent(parent_pid: int) -> None:
    """Exit when rank 0's process is gone (killed with no chance to stop us)."""

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="paged-tp-parent-watch", daemon=True).start()
