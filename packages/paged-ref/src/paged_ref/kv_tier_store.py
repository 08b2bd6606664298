"""The worker's side of the KV cache tiers: the bytes of saved blocks, in host memory and on disk.

``KVTierStore`` carries out, in order, the commands the scheduler's
``TierDirectory`` (paged_core/kv_tiers.py) queued: ``save`` copies a pool
block (every cache layer's K and V of this rank, scales included, as
stored) into the host tier and/or a file, ``load`` writes a host-tier block
back into a pool block, ``fetch`` reads a file into the host tier after
checking it, ``drop_host`` / ``drop_disk`` forget one. A disk that cannot
be written (full, read-only) degrades to no disk tier, with one warning:
the directory's later fetch finds no file and the block is recomputed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from paged_ref.kv_tensors import KVCacheTensors
from paged_ref.kv_tier_files import (
    SUFFIX,
    BadBlockFile,
    block_folder,
    read_block,
    scan_blocks,
    write_block,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StoreCounters:
    """Bytes moved each way, the time restores took, failures by kind."""

    bytes_saved: int = 0
    bytes_restored: int = 0
    bytes_read_from_disk: int = 0
    restore_seconds: float = 0.0
    disk_write_failures: int = 0
    disk_read_failures: int = 0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class KVTierStore:
    """One rank's tier bytes over ``tensors``; ``disk_dir``: the disk tier's
    root (None: no disk tier); ``fp``: the cache's fingerprint
    (``kv_tier_files.fingerprint``), naming its folder there."""

    def __init__(self, tensors: KVCacheTensors, fp: str, disk_dir: str | None = None) -> None:
        self.tensors = tensors
        self.fp = fp
        parts = (tensors.k_cache, tensors.v_cache, tensors.k_scales, tensors.v_scales)
        self._parts = [t for t in parts if t is not None]  # each indexed [layers, block, ...]
        self._sizes = [t[:, 0].numel() * t.element_size() for t in self._parts]
        self.block_bytes = sum(self._sizes)
        self.host: dict[bytes, Tensor] = {}
        self.folder: Path | None = None
        self.counters = StoreCounters()
        self._warned: set[str] = set()
        if disk_dir is not None:
            self.folder = block_folder(disk_dir, fp)
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                self._warn("mkdir", f"KV disk tier {self.folder}: cannot create it ({exc}); "
                           "no disk tier on this rank, blocks are recomputed instead")  # fmt: skip
                self.folder = None

    # -- the commands -----------------------------------------------------------------
    def apply(self, commands: Sequence[tuple[Any, ...]]) -> list[bool]:
        """Carry out ``commands`` in order; one bool per ``fetch`` (read back intact)."""
        fetched: list[bool] = []
        for command in commands:
            kind, key = command[0], command[1]
            if kind == "save":
                _, _, tokens, block_id, to_host, to_disk = command
                self._save(key, tokens, block_id, to_host, to_disk)
            elif kind == "load":
                self._load(key, command[2])
            elif kind == "fetch":
                fetched.append(self._fetch(key, command[2]))
            elif kind == "drop_host":
                self.host.pop(key, None)
            elif kind == "drop_disk" and self.folder is not None:
                with contextlib.suppress(OSError):  # unwritable: warned once at the write
                    (self.folder / (key.hex() + SUFFIX)).unlink(missing_ok=True)
        return fetched

    def scan(self) -> list[tuple[bytes, tuple[int, ...]]]:
        """The disk tier's valid files (a warm start), least recently written first."""
        if self.folder is None or not self.folder.is_dir():
            return []
        return scan_blocks(self.folder, self.fp)

    # -- internals ----------------------------------------------------------------------
    def _save(self, key: bytes, tokens: tuple[int, ...], block_id: int, to_host: bool, to_disk: bool) -> None:
        data = torch.cat([t[:, block_id].reshape(-1).view(torch.uint8) for t in self._parts]).cpu()
        self.counters.bytes_saved += self.block_bytes
        if to_host:
            self.host[key] = data
        if to_disk and self.folder is not None:
            try:
                write_block(self.folder, self.fp, key, tokens, data.numpy().tobytes())
            except OSError as exc:
                self.counters.disk_write_failures += 1
                self._warn("write", f"KV disk tier {self.folder}: cannot write ({exc}); "
                           "blocks not written there are recomputed when needed")  # fmt: skip

    def _load(self, key: bytes, block_id: int) -> None:
        start = time.perf_counter()
        data = self.host[key].to(self.tensors.device)
        offset = 0
        for t, size in zip(self._parts, self._sizes, strict=True):
            dst = t[:, block_id]
            dst.copy_(data[offset : offset + size].view(t.dtype).view(dst.shape))
            offset += size
        self.counters.bytes_restored += self.block_bytes
        self.counters.restore_seconds += time.perf_counter() - start

    def _fetch(self, key: bytes, tokens: tuple[int, ...]) -> bool:
        if self.folder is None:
            return False
        path = self.folder / (key.hex() + SUFFIX)
        try:
            payload = read_block(self.folder, self.fp, key, tokens)
            if len(payload) != self.block_bytes:
                raise BadBlockFile(f"holds {len(payload)} bytes, a block takes {self.block_bytes}")
        except (OSError, BadBlockFile) as exc:
            self.counters.disk_read_failures += 1
            if isinstance(exc, FileNotFoundError):
                return False  # never written (a failed write warned) or removed since
            if isinstance(exc, BadBlockFile):
                path.unlink(missing_ok=True)
            self._warn(f"read {type(exc).__name__}", f"KV disk tier: {path.name} not restored, "
                       f"its tokens are recomputed: {exc}")  # fmt: skip
            return False
        self.host[key] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self.counters.bytes_read_from_disk += len(payload)
        return True

    def _warn(self, kind: str, message: str) -> None:
        """One warning per kind of failure (the counters count every one)."""
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("%s", message)
