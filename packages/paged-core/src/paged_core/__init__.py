"""paged-core: protocols, block allocator and block manager. No tensors, no kernels."""

from paged_core.block_allocator import BlockAllocator
from paged_core.block_manager import BlockManager, UnknownSequenceError
from paged_core.block_manager_stats import BlockManagerStats
from paged_core.block_pool import BlockPool
from paged_core.errors import OutOfBlocksError
from paged_core.protocols import (
    AttentionViewProtocol,
    CachePoolProtocol,
    KVCacheProtocol,
    ServingPoolProtocol,
)

__all__ = [
    "AttentionViewProtocol",
    "BlockAllocator",
    "BlockManager",
    "BlockManagerStats",
    "BlockPool",
    "CachePoolProtocol",
    "KVCacheProtocol",
    "OutOfBlocksError",
    "ServingPoolProtocol",
    "UnknownSequenceError",
]
