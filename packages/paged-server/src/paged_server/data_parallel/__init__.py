"""Data parallelism: N engine replicas, one process each, behind one API server.

``engine`` is the `EngineLike` the server drives (``DataParallelEngine``),
``replica`` each replica process's loop, ``balancer`` the choice of replica
(least load, prefix locality). ``paged-server serve --data-parallel-size N``.
"""

from __future__ import annotations

from paged_server.data_parallel.engine import DataParallelEngine

__all__ = ["DataParallelEngine"]
