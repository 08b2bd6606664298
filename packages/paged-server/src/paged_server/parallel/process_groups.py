"""The process groups of one parallel engine, and what goes over them.

Groups over one rendezvous store: the *device* group carries the forward
pass's all-reduces among the ranks of one pipeline stage (NCCL on CUDA,
gloo on CPU); the *message* group (always gloo, on the host, every rank)
carries rank 0's per-step message to the other ranks, as vLLM keeps its
metadata off the GPU; with pipeline parallelism the *pipe* group (every
rank, the device's backend) carries activations from each stage to the
next and the last stage's logits back to rank 0, point to point. Ranks
are numbered as vLLM does: ``rank = stage * tensor_parallel_size +
tp_rank``. Every collective a rank makes goes through ``TPGroup``, which
counts them.

The groups are built directly from a ``TCPStore`` (no global default
group), so one process may hold several engines, one after another or side
by side.
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from paged_server.platform import platform_for

# Each step's message travels in one fixed-size broadcast; a larger message
# (a big batch's page tables) sends its remainder in a second one.
MESSAGE_BYTES = 64 * 1024
_HEADER = 8  # the payload's length, little-endian
# Workers wait for the next step as long as the server idles, and every rank
# waits at the start-up barrier as long as the slowest loads its shard; a dead
# peer closes its sockets, which ends either wait at once. Joining the groups
# and everything else keep the groups' own timeout, so a rank that dies while
# they form cannot hang the others.
IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclass(slots=True)
class CommCounts:
    """Collectives this rank has made (tests and the benchmark read these)."""

    all_reduces: int = 0
    broadcasts: int = 0
    messages: int = 0  # step messages; each is 1 broadcast, 2 when over MESSAGE_BYTES
    sends: int = 0  # point to point, pipeline parallelism only
    recvs: int = 0


class TPGroup:
    """This rank's end of the device, message and pipe groups (``rank`` and
    ``world_size`` count every rank; ``tp_size`` ranks form a stage)."""

    def __init__(
        self, rank: int, world_size: int, device_pg: Any, message_pg: Any,
        tp_size: int | None = None, pipe_pg: Any = None,
    ) -> None:  # fmt: skip
        self.rank, self.world_size = rank, world_size
        self.tp_size = tp_size or world_size
        self.device_pg = device_pg
        self.message_pg = message_pg
        self.pipe_pg = pipe_pg  # None without pipeline parallelism
        self.counts = CommCounts()
        self._buffer = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)

    @classmethod
    def connect(
        cls,
        store: dist.Store,
        rank: int,
        world_size: int,
        device: torch.device,
        collective_timeout_s: float = 600.0,
        tp_size: int | None = None,
    ) -> TPGroup:
        """Join the groups (blocks until every rank has joined); ``tp_size``:
        ranks per pipeline stage (default: all, one stage)."""
        tp = tp_size or world_size
        timeout = datetime.timedelta(seconds=collective_timeout_s)
        message_pg = dist.ProcessGroupGloo(
            dist.PrefixStore("message", store), rank, world_size, timeout
        )
        stage_store = dist.PrefixStore(f"device{rank // tp}", store)
        device_pg = _device_group(stage_store, rank % tp, tp, device, timeout)
        pipe_pg = None
        if world_size > tp:
            pipe_pg = _device_group(dist.PrefixStore("pipe", store), rank, world_size, device, timeout)
        return cls(rank, world_size, device_pg, message_pg, tp, pipe_pg)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place."""
        self.counts.all_reduces += 1
        self.device_pg.allreduce([tensor]).wait()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Pending:
        """Start sending ``tensor`` to rank ``dst`` (pipeline parallelism);
        ``wait()`` on the result before ``tensor`` is reused. A send
        completes only once ``dst`` has posted the matching receive."""
        self.counts.sends += 1
        tensor = tensor.contiguous()
        return Pending(self.pipe_pg.send([tensor], dst, tag), tensor)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Pending:
        """Start receiving into ``tensor`` from rank ``src`` (the send with
        the same ``tag``); ``wait()`` returns it, filled."""
        self.counts.recvs += 1
        return Pending(self.pipe_pg.recv([tensor], src, tag), tensor)

    def broadcast_message(self, message: object = None) -> Any:
        """Rank 0 sends ``message`` (pickled); every other rank receives it."""
        self.counts.messages += 1
        buffer = self._buffer
        if self.rank == 0:
            payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            head = payload[: MESSAGE_BYTES - _HEADER]
            buffer[:_HEADER] = torch.frombuffer(bytearray(len(payload).to_bytes(8, "little")), dtype=torch.uint8)
            buffer[_HEADER : _HEADER + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
            self._broadcast(buffer)
            if len(payload) > len(head):
                rest = torch.frombuffer(bytearray(payload[len(head) :]), dtype=torch.uint8)
                self._broadcast(rest)
            return message
        self._broadcast(buffer)
        size = int.from_bytes(buffer[:_HEADER].numpy().tobytes(), "little")
        data = buffer[_HEADER : _HEADER + min(size, MESSAGE_BYTES - _HEADER)].numpy().tobytes()
        if size > len(data):
            rest = torch.empty(size - len(data), dtype=torch.uint8)
            self._broadcast(rest)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def min_over_ranks(self, value: int) -> int:
        """The least of every rank's ``value`` (the KV cache's blocks: every
        rank must hold every block id)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        self.message_pg.allreduce([tensor], _min_options()).wait()
        return int(tensor.item())

    def min_each(self, values: list[int]) -> list[int]:
        """``min_over_ranks`` of each of ``values`` in one all-reduce (which KV
        tier blocks every rank holds)."""
        tensor = torch.tensor(values, dtype=torch.int64)
        self.message_pg.allreduce([tensor], _min_options()).wait()
        return [int(v) for v in tensor.tolist()]

    def barrier_ok(self, ok: bool) -> bool:
        """Start-up handshake: whether every rank reports ``ok`` (a rank that
        died instead makes this raise)."""
        flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.timeout = IDLE_TIMEOUT
        self.message_pg.allreduce([flag], options).wait()
        return int(flag.item()) == 0

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.counts.broadcasts += 1
        timeout = IDLE_TIMEOUT if self.rank else None  # a worker waits for the next step
        self.message_pg.broadcast(tensor, 0, timeout).wait()


class Pending:
    """A point-to-point transfer in flight; holds its tensor until it is done."""

    __slots__ = ("_tensor", "_work")

    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self._work, self._tensor = work, tensor

    def wait(self) -> torch.Tensor:
        """Block until the transfer is done; returns its tensor."""
        self._work.wait()
        return self._tensor


def _min_options() -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    return options


def _device_group(
    store: dist.Store, rank: int, size: int, device: torch.device, timeout: datetime.timedelta
) -> Any:
    """A group on the device's backend: NCCL on CUDA, gloo on CPU."""
    return platform_for(device).device_group(store, rank, size, timeout)
