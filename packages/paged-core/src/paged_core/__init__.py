"""paged-core: protocols, block pool and block manager. No tensors, no kernels."""

from paged_core.block_manager import BlockManager
from paged_core.block_pool import Block, BlockPool
from paged_core.block_stats import MISS_REASONS, BlockManagerStats
from paged_core.errors import OutOfBlocksError, UnknownSequenceError
from paged_core.kv_cache_groups import KVCacheGroup, cache_layers, kv_cache_groups
from paged_core.protocols import (
    AttentionViewProtocol,
    CachePoolProtocol,
    KVCacheProtocol,
    ServingPoolProtocol,
)

__all__ = [
    "MISS_REASONS",
    "AttentionViewProtocol",
    "Block",
    "BlockManager",
    "BlockManagerStats",
    "BlockPool",
    "CachePoolProtocol",
    "KVCacheGroup",
    "KVCacheProtocol",
    "OutOfBlocksError",
    "ServingPoolProtocol",
    "UnknownSequenceError",
    "cache_layers",
    "kv_cache_groups",
]
