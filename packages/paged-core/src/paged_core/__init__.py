"""paged-core: protocols, block pool and block manager. No tensors, no kernels."""

from paged_core.block_manager import MISS_REASONS, BlockManager, BlockManagerStats
from paged_core.block_pool import Block, BlockPool
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
    "ServingPoolProtocol",
    "UnknownSequenceError",
]
