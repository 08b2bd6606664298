"""The scheduler's view of the KV cache tiers behind the pool: ``TierDirectory``.

Every full block that enters the prefix cache is also saved, as stored, to
a host-memory tier and (when configured) a disk tier, keyed by the same
chained block hash, so a prompt whose blocks the pool has evicted can have
them restored instead of recomputed. This side holds no bytes: it decides
(which keys each tier keeps, LRU within a size limit in blocks) and queues
commands, in order, for every rank's ``KVTierStore`` (paged_ref) to carry
out before the next forward pass: ``save``, ``load`` (into a pool block),
``fetch`` (disk -> host, checked), ``drop_host``, ``drop_disk``. One issuer,
one queue: the ranks' stores stay the same as this directory says.

A block is restored from the host tier only; a disk block is fetched into it
first (``fetch_plan``), so a bad file is found before a prompt counts on it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from paged_core.block_pool import BlockHash, hash_block_tokens

__all__ = ["TierCommand", "TierCounters", "TierDirectory"]

TierCommand = tuple[Any, ...]  # ("save", key, tokens, block_id, to_host, to_disk), ("load", key, block_id), ...


@dataclass(slots=True)
class TierCounters:
    """Tokens restored per tier (``disk``: fetched from a file first), blocks
    saved, and keys found bad on a fetch (a rank could not read them)."""

    hits_host_tokens: int = 0
    hits_disk_tokens: int = 0
    saved_blocks: int = 0
    fetched_blocks: int = 0
    fetch_failures: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class TierDirectory:
    """Which keys the host and disk tiers hold (LRU each, ``host_blocks`` and
    ``disk_blocks`` at most; 0 turns a tier off) and the commands that make
    the stores so. ``block_size``: tokens per block, for the counters."""

    def __init__(self, host_blocks: int, disk_blocks: int, block_size: int) -> None:
        if host_blocks < 0 or disk_blocks < 0:
            raise ValueError(f"tier sizes must be >= 0 blocks, got {host_blocks} and {disk_blocks}")
        self.host_blocks, self.disk_blocks, self.block_size = host_blocks, disk_blocks, block_size
        self.host: OrderedDict[BlockHash, tuple[int, ...]] = OrderedDict()  # key -> tokens, LRU first
        self.disk: OrderedDict[BlockHash, tuple[int, ...]] = OrderedDict()
        self._from_disk: set[BlockHash] = set()  # fetched, not restored yet: a disk hit
        self._commands: list[TierCommand] = []
        self.counters = TierCounters()

    # -- what the block manager calls ----------------------------------------------
    def stored(self, key: BlockHash, tokens: Sequence[int], block_id: int) -> None:
        """A computed block entered the prefix cache: save it where it is not yet."""
        tokens = tuple(tokens)
        to_host = self.host_blocks > 0 and key not in self.host
        to_disk = self.disk_blocks > 0 and key not in self.disk
        if key in self.host:
            self.host.move_to_end(key)
        if key in self.disk:
            self.disk.move_to_end(key)
        if not (to_host or to_disk):
            return
        self._commands.append(("save", key, tokens, block_id, to_host, to_disk))
        self.counters.saved_blocks += 1
        if to_host:
            self._put_host(key, tokens)
        if to_disk:
            self.disk[key] = tokens
            self._trim_disk()

    def has(self, key: BlockHash, tokens: Sequence[int]) -> bool:
        """Whether ``key`` can be restored now (in the host tier, same tokens:
        a hash collision never serves wrong KV)."""
        return self.host.get(key) == tuple(tokens)

    def restore(self, key: BlockHash, block_id: int) -> None:
        """Queue ``key``'s bytes into pool block ``block_id`` (after ``has``)."""
        assert key in self.host, "restore only what the host tier holds"
        self.host.move_to_end(key)
        self._commands.append(("load", key, block_id))
        if key in self._from_disk:
            self._from_disk.discard(key)
            self.counters.hits_disk_tokens += self.block_size
        else:
            self.counters.hits_host_tokens += self.block_size

    # -- disk -> host, before a prompt is planned ---------------------------------------
    def fetch_plan(self, token_ids: Sequence[int], cached: Any) -> list[BlockHash]:
        """Disk keys to fetch for a prompt so its leading blocks can be
        restored: walking its chain of full blocks (never the last token's),
        past those ``cached(key, tokens)`` says the pool or the host tier
        holds, the ones only the disk holds; stops at the first miss."""
        bs, parent, out = self.block_size, None, []
        for i in range((len(token_ids) - 1) // bs if self.disk else 0):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = hash_block_tokens(parent, tokens)
            if cached(parent, tokens) or self.has(parent, tokens):
                if parent in self.host:
                    self.host.move_to_end(parent)  # not evicted by this prompt's own fetches
                continue
            if self.disk.get(parent) != tokens:
                break
            out.append(parent)
        return out[: self.host_blocks]  # more would evict the first ones again

    def fetch(self, keys: Sequence[BlockHash]) -> None:
        """Queue ``keys`` from disk into the host tier (``fetched`` then
        reports which every rank read back intact)."""
        for key in keys:
            self._commands.append(("fetch", key, self.disk[key]))
            self._put_host(key, self.disk[key])
            self.disk.move_to_end(key)

    def fetched(self, keys: Sequence[BlockHash], ok: Sequence[bool]) -> None:
        """The stores' answer to ``fetch``: a key some rank could not read back
        (missing, corrupt, another model's) is dropped from both tiers."""
        for key, good in zip(keys, ok, strict=True):
            if good:
                self._from_disk.add(key)
                self.counters.fetched_blocks += 1
                continue
            self.counters.fetch_failures += 1
            if self.host.pop(key, None) is not None:
                self._commands.append(("drop_host", key))
            if self.disk.pop(key, None) is not None:
                self._commands.append(("drop_disk", key))

    def known_on_disk(self, entries: Sequence[tuple[BlockHash, tuple[int, ...]]]) -> None:
        """A warm start: the stores' valid files, oldest first (within the limit)."""
        for key, tokens in entries:
            self.disk[key] = tuple(tokens)
        self._trim_disk()

    # -- each step ------------------------------------------------------------------
    def take_commands(self) -> list[TierCommand]:
        """The commands queued since the last call, in order, for every rank."""
        commands, self._commands = self._commands, []
        return commands

    def stats(self) -> dict[str, int]:
        """The counters and what each tier holds now, in blocks."""
        return {**self.counters.as_dict(), "host_blocks": len(self.host), "disk_blocks": len(self.disk)}

    # -- internals ------------------------------------------------------------------
    def _put_host(self, key: BlockHash, tokens: tuple[int, ...]) -> None:
        self.host[key] = tokens
        self.host.move_to_end(key)
        while len(self.host) > self.host_blocks:
            old, _ = self.host.popitem(last=False)
            self._from_disk.discard(old)
            self._commands.append(("drop_host", old))

    def _trim_disk(self) -> None:
        while len(self.disk) > self.disk_blocks:
            old, _ = self.disk.popitem(last=False)
            self._commands.append(("drop_disk", old))
