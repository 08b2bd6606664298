"""paged-ref: reference KV cache pools, views and gather+SDPA attention ops."""
