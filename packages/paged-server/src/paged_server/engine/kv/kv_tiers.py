"""KV cache tiers for the engine: host memory and disk behind the prefix cache.

``--kv-offloading-size GiB`` (vLLM's flag; the total over tensor-parallel
ranks) keeps every prefix-cache block, as stored, in host memory too;
``--kv-disk-dir DIR`` (``--kv-disk-size GiB``, default 10) also writes it
to a file there, kept across restarts. A prompt whose leading blocks the
pool evicted gets them restored into fresh pool blocks, counted as cached
tokens, instead of recomputed. The scheduler's side is
``paged_core.kv_tiers.TierDirectory`` (inside the block manager's prefix
lookup and commit); each rank's worker runs a ``paged_ref.kv_tier_store``
over its own shard, its commands riding the step's ``StepLayout``. Disk
blocks a new prompt needs are fetched (and checked) into host memory
before the step that plans it (``prefetch``), one call to every rank.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any

import torch

from paged_core.block_pool import BlockHash
from paged_core.kv_tiers import TierDirectory
from paged_ref.kv_spec import KVCacheSpec

if TYPE_CHECKING:
    from paged_server.config import RunConfig

log = logging.getLogger(__name__)

GIB = 1 << 30
DEFAULT_DISK_GIB = 10.0


def cache_identity(worker: Any) -> dict[str, Any]:
    """What a disk block must match to be restored on this rank: the model
    (config, and a digest of a sample of every weight of this rank's shard:
    another checkpoint of the same architecture differs), dtypes, block
    size, layer layout, calibrated scales, and the rank's place.
    ``worker``: the rank's ``Worker`` (not imported: it imports this)."""
    config, loaded = worker.config, worker.loaded
    assert loaded is not None and worker.tensors is not None
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(loaded.model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        sample = flat[:64].cpu().contiguous(), flat[-64:].cpu().contiguous()
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        for part in sample:
            digest.update(part.view(torch.uint8).numpy().tobytes())
    scales = worker.kv_scales
    spec = worker.stage_spec()
    return {
        "model": repr(loaded.config),
        "weights": digest.hexdigest(),
        "dtype": str(loaded.dtype),
        "kv_cache_dtype": config.kv_cache_dtype,
        "block_size": spec.block_size,
        "layout": repr(spec.groups),
        "kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "kv_scales": None if scales is None else repr(scales.summary()),
        "tp": [worker.tp.rank, worker.tp.world_size],
        "pp": [worker.stage.rank, worker.stage.size],
    }


class KVTiers:
    """The engine's handle on the tiers: the directory the block manager
    consults, the prompts waiting for a prefetch, the counters."""

    def __init__(self, directory: TierDirectory, executor: Any) -> None:
        self.directory = directory
        self.executor = executor
        self._prompts: list[list[int]] = []

    def note_prompt(self, token_ids: list[int]) -> None:
        """A new request: its disk blocks are fetched before the next step."""
        if self.directory.disk:
            self._prompts.append(token_ids)

    def prefetch(self, cached: Any) -> None:
        """Fetch the disk blocks the prompts noted since the last step need
        into host memory, on every rank, checked; the queued commands go
        first (one ordered stream). ``cached(key, tokens)``: the pool has it."""
        prompts, self._prompts = self._prompts, []
        keys: list[BlockHash] = []
        for token_ids in prompts:
            for key in self.directory.fetch_plan(token_ids, cached):
                if key not in keys:
                    keys.append(key)
        if not keys:
            return
        self.directory.fetch(keys)
        ok = self.executor.collective_rpc("tier_sync", self.directory.take_commands())
        self.directory.fetched(keys, ok)

    def flush(self) -> None:
        """Carry out the queued commands now (at shutdown: the blocks saved
        since the last step reach the disk)."""
        if commands := self.directory.take_commands():
            self.executor.collective_rpc("tier_sync", commands)

    def metrics(self, worker: Any) -> dict[str, float]:
        """``kv_offload_*``: the directory's counters and rank 0's store's
        (``_total``: counters; ``host_blocks`` / ``disk_blocks``: gauges)."""
        stats: dict[str, float] = dict(self.directory.stats())
        if worker.tier_store is not None:
            stats.update(worker.tier_store.counters.as_dict())
        gauges = ("host_blocks", "disk_blocks")
        return {f"kv_offload_{k}{'' if k in gauges else '_total'}": float(v) for k, v in stats.items()}


def attach_tiers(config: RunConfig, spec: KVCacheSpec, kv_manager: Any, executor: Any) -> KVTiers | None:
    """Build the tiers the config asks for over ``kv_manager``'s block
    manager, every rank's store, and (a warm start) the disk blocks every
    rank holds valid. None without tiers. ``ValueError`` (one line) where
    they cannot run: a hybrid (sliding-window) KV cache."""
    if not config.uses_kv_tiers:
        return None
    flag = "--kv-offloading-size" if config.kv_offloading_size else "--kv-disk-dir"
    if len(spec.groups) > 1:
        raise ValueError(
            f"{flag}: the KV tiers keep one KV cache group; this model's sliding-window layers make "
            "several: add --disable-hybrid-kv-cache-manager or drop the flag"
        )
    if not config.enable_prefix_caching:
        log.warning("%s: the KV tiers keep prefix-cache blocks, which --no-enable-prefix-caching turns off; no tiers", flag)
        return None
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    block_bytes = spec.block_bytes()  # rank 0's; every rank holds as many blocks
    host = int((config.kv_offloading_size or 0) * GIB / ranks) // block_bytes
    disk = 0
    if config.kv_disk_dir is not None:
        disk_gib = DEFAULT_DISK_GIB if config.kv_disk_size is None else config.kv_disk_size
        disk = int(disk_gib * GIB / ranks) // block_bytes
        # Disk blocks are restored through host memory: room for one longest prompt at least.
        host = max(host, -(-config.max_model_len // spec.block_size)) if disk else host
    directory = TierDirectory(host, disk, spec.block_size)
    found = executor.collective_rpc("init_tiers", config.kv_disk_dir)
    if disk and found:
        ok = executor.collective_rpc("tier_agree", [key for key, _ in found])
        directory.known_on_disk([entry for entry, good in zip(found, ok, strict=True) if good])
    kv_manager.block_manager.tiers = directory
    log.info(
        "KV cache tiers: host memory %d blocks (%.2f GiB), disk %s; %d blocks found on disk",
        host, host * block_bytes / GIB,
        f"{disk} blocks in {config.kv_disk_dir}" if disk else "off", len(directory.disk),
    )  # fmt: skip
    return KVTiers(directory, executor)

