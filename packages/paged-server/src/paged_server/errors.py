"""Exceptions the engine raises to its callers (the HTTP server maps them to status codes)."""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """The waiting queue already holds ``max_queue_len`` requests; the caller
    should retry later (HTTP 503)."""
