"""paged-core: protocols, block pool and block manager. No tensors, no kernels."""

from paged_core.block_manager import BlockManager
from paged_core.block_pool import Block, BlockPool
from paged_core.block_stats import MISS_REASONS, BlockManagerStats, PrefixCounters
from paged_core.errors import OutOfBlocksError, UnknownSequenceError
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
    "KVCacheProtocol",
    "OutOfBlocksError",
    "PrefixCounters",
    "ServingPoolProtocol",
    "UnknownSequenceError",
]
