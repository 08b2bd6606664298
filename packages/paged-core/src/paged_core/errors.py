"""Exceptions shared by the cache backends."""


class OutOfBlocksError(RuntimeError):
    """Fewer free KV blocks (or contiguous rows) than asked for. The engine reacts by
    waiting or preempting; it never fails a request for this."""


class UnknownSequenceError(ValueError, KeyError):
    """A sequence id the block manager does not hold (never allocated, or
    already freed). Both a ``ValueError`` and a ``KeyError``."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
