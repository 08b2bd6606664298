"""Tensor and pipeline parallelism over ``torch.distributed``: one model across several devices.

``executor`` is rank 0's side (the engine process), ``worker`` the other
ranks' processes (each runs the same ``engine.worker.Worker`` as rank 0),
``process_groups`` the process groups and what crosses them,
``step_message`` the one message per worker call. Across nodes, ``rendezvous`` is
where the ranks meet (torch.distributed's env:// store) and ``node_worker``
runs the ranks of another node (``paged-server worker``, or torchrun's). The sharded layers are model code
(``paged_server.models.tensor_parallel``).
"""

from __future__ import annotations

from paged_server.errors import WorkerStartError
from paged_server.parallel.process_groups import CommCounts, TPGroup

__all__ = ["CommCounts", "TPGroup", "WorkerStartError"]
