"""Errors the loader raises, each naming what was wrong and what to do.

They subclass the built-in exception a caller would expect
(``FileNotFoundError``, ``ValueError``) so generic handlers still work.
"""

from __future__ import annotations

from paged_server.errors import ModelFileNotFoundError, ModelLoadError  # noqa: F401 (re-exported)


class UnsupportedArchitectureError(ModelLoadError, ValueError):
    """config.json names an architecture this server has no model code for."""


class CheckpointMismatchError(ModelLoadError, ValueError):
    """A weight is missing, or its shape does not match config.json."""


class CorruptCheckpointError(ModelLoadError, ValueError):
    """A weights file cannot be read (truncated or damaged)."""


class InvalidConfigError(ModelLoadError, ValueError):
    """config.json is unreadable or lacks a field the model needs."""


class LoRAAdapterError(ModelLoadError, ValueError):
    """A LoRA adapter cannot be served: unreadable, of a kind not supported,
    or not made for this model."""
