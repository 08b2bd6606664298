"""Every attention backend, one line each, and the one place one is chosen.

A backend is a class satisfying ``paged_core.attention_backend.AttentionBackend``
(capability flags + calls); the engine reads its flags, never its name.
Adding one: its file, and its line in ``BACKENDS`` (the name users pass as
``attention_backend``). Classes are imported on first use, so naming
Triton's costs nothing where it does not run.
"""

from __future__ import annotations

import importlib

from paged_core.attention_backend import AttentionBackend

BACKENDS: dict[str, str] = {  # attention_backend -> "module:class"
    "ref": "paged_ref.ref_backend:RefBackend",
    "cpu": "paged_ref.cpu.cpu_backend:CpuKernelsBackend",
    "triton": "paged_triton.triton_backend:TritonBackend",
}
REFERENCE = "ref"  # what defines the semantics; the contiguous cache always runs it


def backend_class(name: str) -> type[AttentionBackend]:
    """The class registered as ``name``."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be 'auto' or one of {sorted(BACKENDS)}, got {name!r}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def resolve(requested: str, device_type: str, kv_cache_dtype: str, block_size: int) -> str:
    """The concrete backend for ``requested`` (``auto``: the first whose
    ``auto_for`` names the device), refused at start-up (not on the first
    request) where it cannot run here or take the cache's dtype or blocks."""
    if requested == "auto":
        name = next((n for n in BACKENDS if device_type in backend_class(n).auto_for), REFERENCE)
    else:
        name = requested
    cls = backend_class(name)
    reason = cls.unavailable(device_type)
    if reason is not None:
        raise ValueError(reason)
    if cls.kv_dtypes is not None and kv_cache_dtype not in cls.kv_dtypes:
        raise ValueError(
            f"attention_backend {name!r} takes kv_cache_dtype {' / '.join(cls.kv_dtypes)}, "
            f"not {kv_cache_dtype!r}; pick one of those or another attention_backend"
        )
    if cls.block_sizes is not None and block_size not in cls.block_sizes:
        raise ValueError(
            f"attention_backend {name!r} takes block_size {' / '.join(map(str, cls.block_sizes))}, "
            f"not {block_size}; pick one of those or another attention_backend"
        )
    return name


def build(name: str, *, paged: bool = True, compiled: bool = False) -> AttentionBackend:
    """The backend a worker's cache runs for the resolved ``name``: the
    reference for a contiguous cache; a compiled pass's ``compiled_variant``."""
    cls = backend_class(name if paged else REFERENCE)
    if compiled and paged and cls.compiled_variant is not None:
        cls = backend_class(cls.compiled_variant)
    return cls()  # type: ignore[call-arg]
