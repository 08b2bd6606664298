"""paged-core: protocols, block pool and block manager. No tensors, no kernels."""

from paged_core.block_manager import DEFAULT_BLOCK_SIZE, BlockManager
from paged_core.block_pool import Block, BlockPool
from paged_core.block_stats import MISS_REASONS, BlockManagerStats
from paged_core.errors import OutOfBlocksError, UnknownSequenceError
from paged_core.kv_cache_groups import KVCacheGroup, cache_layers, kv_cache_groups
from paged_core.protocols import (
    AttentionViewProtocol,
    CachePoolProtocol,
    KVCacheManagerProtocol,
    KVCacheProtocol,
    ServingPoolProtocol,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "MISS_REASONS",
    "AttentionViewProtocol",
    "Block",
    "BlockManager",
    "BlockManagerStats",
    "BlockPool",
    "CachePoolProtocol",
    "KVCacheGroup",
    "KVCacheManagerProtocol",
    "KVCacheProtocol",
    "OutOfBlocksError",
    "ServingPoolProtocol",
    "UnknownSequenceError",
    "cache_layers",
    "kv_cache_groups",
]
