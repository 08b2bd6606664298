"""Exceptions shared by the cache backends."""


class OutOfBlocksError(RuntimeError):
    """Fewer free KV blocks (or slots) than asked for. The engine reacts by
    waiting or preempting; it never fails a request for this."""
