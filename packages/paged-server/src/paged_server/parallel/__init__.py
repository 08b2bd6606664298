"""Tensor parallelism over ``torch.distributed``: one model across several devices.

``executor`` is rank 0's side (the engine process), ``worker`` the other
ranks', ``process_groups`` the process groups and what crosses them,
``step_message`` the one message per step. Across nodes, ``rendezvous`` is
where the ranks meet (torch.distributed's env:// store) and ``node_worker``
runs the ranks of another node (``paged-server worker``, or torchrun's). The sharded layers are model code
(``paged_server.models.tensor_parallel``).
"""

from __future__ import annotations

from paged_server.parallel.executor import TensorParallelExecutor, WorkerStartError
from paged_server.parallel.process_groups import CommCounts, TPGroup

__all__ = ["CommCounts", "TPGroup", "TensorParallelExecutor", "WorkerStartError"]
