"""Exceptions the engine raises to its callers (the HTTP server maps them to
status codes), and the base of the model-loading ones (the tokenizer raises
one too, so it lives here, below both)."""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """The waiting queue already holds ``max_queue_len`` requests; the caller
    should retry later (HTTP 503)."""


class ContextLengthError(ValueError):
    """The prompt (or prompt + ``max_tokens``) does not fit ``max_model_len``
    (HTTP 400 with OpenAI's ``context_length_exceeded`` code)."""


class ModelLoadError(Exception):
    """Base class for every problem found while loading a model directory
    (the rest are in ``models/errors.py``)."""


class ModelFileNotFoundError(ModelLoadError, FileNotFoundError):
    """The model directory, or a file it must contain (the tokenizer's too), is missing."""


class EngineFailedError(RuntimeError):
    """The engine cannot go on (a tensor-parallel rank died, or the ranks
    disagree after a failed step): every in-flight request fails with this
    message and the server reports unhealthy (HTTP 500 for requests in
    flight, 503 afterwards)."""


class WorkerStartError(RuntimeError):
    """A worker of a tensor- or pipeline-parallel engine did not start (the
    message ends with its error; its traceback is on stderr)."""


def describe_error(exc: BaseException) -> str:
    """An exception as one short line for a request's error: its type and
    the first line of its message (some libraries append pages of state)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"
