"""The attention backend registry: every line names a class that is an
``AttentionBackend`` under that name; ``resolve`` picks and refuses from
the flags; ``build`` gives a worker's cache its backend."""

from __future__ import annotations

import pytest

from paged_core.attention_backend import AttentionBackend
from paged_ref.cpu.cpu_backend import CpuKernelsBackend
from paged_ref.ops_backend import OpsBackend
from paged_ref.ref_backend import RefBackend
from paged_server import attention_backends
from paged_server.attention_backends import BACKENDS, backend_class, build, resolve


class Int8Only(OpsBackend):
    """A backend that takes only an int8 cache in blocks of 16."""

    name = "int8only"
    kv_dtypes = ("int8",)
    block_sizes = (16,)


def test_every_registered_backend_is_one_under_its_name() -> None:
    assert {"ref", "cpu", "triton"} <= set(BACKENDS)  # a new backend adds its line, nothing here
    for name in BACKENDS:
        cls = backend_class(name)
        assert cls.name == name
        assert isinstance(cls(), AttentionBackend)  # type: ignore[call-arg]


def test_auto_picks_by_device_and_the_flags_refuse_what_a_backend_cannot_take(monkeypatch) -> None:
    assert resolve("auto", "cpu", "auto", 16) == "ref"
    assert resolve("auto", "cuda", "auto", 16) == "triton"
    assert resolve("cpu", "cpu", "int8", 16) == "cpu"
    with pytest.raises(ValueError, match="'cpu' runs on cpu, not cuda"):
        resolve("cpu", "cuda", "auto", 16)
    monkeypatch.setitem(BACKENDS, "int8only", f"{__name__}:Int8Only")
    assert resolve("int8only", "cpu", "int8", 16) == "int8only"
    with pytest.raises(ValueError, match="takes kv_cache_dtype int8, not 'fp8'"):
        resolve("int8only", "cpu", "fp8", 16)
    with pytest.raises(ValueError, match="takes block_size 16, not 32"):
        resolve("int8only", "cpu", "int8", 32)


def test_build_runs_the_reference_on_contiguous_caches_and_the_c_kernels_when_compiled() -> None:
    assert type(build("ref")) is RefBackend
    assert type(build("ref", compiled=True)) is CpuKernelsBackend  # RefBackend.compiled_variant
    assert type(build("ref", paged=False, compiled=True)) is RefBackend
    assert type(build("cpu", paged=False)) is RefBackend
    with pytest.raises(ValueError, match="one of"):
        attention_backends.backend_class("flash")
