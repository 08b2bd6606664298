"""paged-ref: reference KV cache pools, views and gather+SDPA attention ops.

Never imports triton: the Triton backend passes its own ``ops`` module to
:class:`PagedKVCachePool`.
"""

from paged_ref import ops
from paged_ref.paged_pool import PagedKVCachePool
from paged_ref.paged_views import (
    PagedBatchedPrefillCacheView,
    PagedCacheView,
    PagedDecodeCacheView,
    PagedPrefillCacheView,
)
from paged_ref.slotted import SlottedKVCache
from paged_ref.slotted_views import (
    BatchedPrefillCacheView,
    DecodeCacheView,
    PrefillCacheView,
    SlottedCacheView,
)

__all__ = [
    "BatchedPrefillCacheView",
    "DecodeCacheView",
    "PagedBatchedPrefillCacheView",
    "PagedCacheView",
    "PagedDecodeCacheView",
    "PagedKVCachePool",
    "PagedPrefillCacheView",
    "PrefillCacheView",
    "SlottedCacheView",
    "SlottedKVCache",
    "ops",
]
