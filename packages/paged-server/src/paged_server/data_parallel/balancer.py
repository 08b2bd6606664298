"""Which replica gets a request: prefix locality first, then the least load.

Pure bookkeeping, no processes. Load is vLLM's data-parallel score,
``4 * waiting + running`` (a waiting request costs a replica more than a
running one: it is latency the client already sees), with KV usage and then
the fewest requests routed so far breaking ties, so idle replicas take turns.

Locality: each full block of a prompt gets a hash chaining its parent's (as
the block manager's prefix cache does), remembered with the replica it was
sent to. A new prompt goes to the replica that holds its longest remembered
prefix, whose prefix cache likely still has those blocks, unless that
replica is busier than the least-loaded one by more than ``slack`` (then
recomputing the prefix elsewhere costs less than queueing behind it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class ReplicaLoad:
    """One replica's load as the balancer sees it."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # 0..1
    routed: int = 0  # requests sent to it so far
    alive: bool = True

    @property
    def score(self) -> int:
        return 4 * self.waiting + self.running


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One hash per full block of ``token_ids``, each chaining its parent's."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


class Balancer:
    """Picks a replica per request (see module doc)."""

    def __init__(self, loads: list[ReplicaLoad], block_size: int, slack: int, max_entries: int = 1 << 16) -> None:
        self.loads = loads
        self.block_size = block_size
        self.slack = slack  # how much busier the prefix's replica may be
        self.max_entries = max_entries  # prefix hashes remembered (LRU)
        self._owner: OrderedDict[int, int] = OrderedDict()  # block hash -> replica
        self.by_prefix = 0  # requests routed by locality (counted for /metrics)

    def choose(self, token_ids: Sequence[int]) -> tuple[int, bool]:
        """(replica index, whether prefix locality chose it); ``RuntimeError``
        when no replica is alive. Call ``record`` once the replica took it."""
        alive = [i for i, load in enumerate(self.loads) if load.alive]
        if not alive:
            raise RuntimeError("no data-parallel replica is alive")
        least = min(alive, key=lambda i: (self.loads[i].score, self.loads[i].kv_usage, self.loads[i].routed, i))
        preferred = self._prefix_owner(token_ids)
        if (
            preferred is not None
            and preferred != least
            and self.loads[preferred].score <= self.loads[least].score + self.slack
        ):
            return preferred, True
        return least, preferred == least

    def record(self, token_ids: Sequence[int], replica: int, by_prefix: bool) -> None:
        """Remember that ``replica`` now holds ``token_ids``' prefix blocks."""
        self.loads[replica].routed += 1
        self.by_prefix += by_prefix
        for h in block_hashes(token_ids, self.block_size):
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)

    def _prefix_owner(self, token_ids: Sequence[int]) -> int | None:
        """The live replica holding the longest remembered prefix of ``token_ids``."""
        found = None
        for h in block_hashes(token_ids, self.block_size):
            owner = self._owner.get(h)
            if owner is None:
                break  # chained hashes: no longer prefix can be remembered
            if self.loads[owner].alive:
                found = owner
        return found
