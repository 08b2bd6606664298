"""paged-ref: reference KV cache pools, the cache view and gather+SDPA attention ops.

Never imports triton: the Triton backend passes its own ``ops`` module to
:class:`PagedKVPool`.
"""

from paged_ref import ops
from paged_ref.attention_metadata import AttentionMetadata, build_metadata
from paged_ref.cache_view import CacheView
from paged_ref.contiguous_pool import ContiguousKVPool
from paged_ref.paged_pool import PagedKVPool

__all__ = [
    "AttentionMetadata",
    "CacheView",
    "PagedKVPool",
    "ContiguousKVPool",
    "build_metadata",
    "ops",
]
