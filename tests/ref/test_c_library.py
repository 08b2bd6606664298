"""The C kernels' build cache (``paged_ref.cpu.c_library``): a truncated library
is rebuilt, not mapped (SIGBUS); an unusable cache directory is one warning
and the reference path; the cache is keyed by the CPU as well as the source.

Each test builds a one-function library into a cache of its own."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paged_ref.cpu import c_library

pytestmark = pytest.mark.skipif(c_library.compiler() is None, reason="no C compiler")

SOURCE = "int add(int a, int b) { return a + b; }\n"
# A child process: a library that is mapped truncated kills it with SIGBUS.
CHILD = """
import logging, sys
from pathlib import Path
from paged_ref.cpu import c_library
logging.basicConfig(format="%(levelname)s %(message)s")
lib = c_library.build(Path(sys.argv[1]), (), "test", "add")
print("reference" if lib is None else lib.add(2, 3))
"""


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "add.c"
    path.write_text(SOURCE)
    return path


def _child(source: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PAGED_CACHE_DIR": str(cache)}
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(source)], capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip


def test_a_truncated_library_is_rebuilt_with_one_warning(source: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _child(source, cache)
    assert (first.returncode, first.stdout.strip(), first.stderr) == (0, "5", "")
    (library,) = (cache / "test").glob("*.so")
    size = library.stat().st_size
    with library.open("r+b") as f:  # a copy or a build cut short
        f.truncate(size // 4)
    second = _child(source, cache)
    assert second.returncode == 0, f"exit {second.returncode}: {second.stderr[-1000:]}"
    assert second.stdout.strip() == "5"
    warnings = second.stderr.strip().splitlines()
    assert len(warnings) == 1 and "does not match its checksum" in warnings[0], warnings
    assert library.stat().st_size == size and c_library.verified(library)
    third = _child(source, cache)  # verified: loaded quietly
    assert (third.returncode, third.stdout.strip(), third.stderr) == (0, "5", "")


@pytest.mark.parametrize("kind", ["not a directory", "read-only"])
def test_an_unusable_cache_is_one_warning_and_the_reference_path(
    kind: str, source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    cache = tmp_path / "cache"
    if kind == "not a directory":
        cache.write_text("")
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only directory")
        (cache / "test").mkdir(parents=True)
        (cache / "test").chmod(0o555)
    monkeypatch.setenv("PAGED_CACHE_DIR", str(cache))
    caplog.set_level(logging.WARNING, logger="paged_ref.cpu.c_library")
    assert c_library.build(source, (), "test", "add") is None
    assert c_library.build(source, ("-DSECOND",), "test", "add2") is None  # a second kernel
    assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
    assert "PAGED_CACHE_DIR" in caplog.records[0].getMessage()


def test_the_cache_key_follows_the_cpu(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2\n\nprocessor\t: 1\n"
    other = info.replace("avx2", "avx2 avx512f")
    assert c_library.cpu_features(info) != c_library.cpu_features(other)
    assert c_library.cpu_features(info) == c_library.cpu_features(info + "flags\t: x\n")
    key = c_library.cache_key("src", ["cc"], c_library.cpu_features(info))
    assert key != c_library.cache_key("src", ["cc"], c_library.cpu_features(other))
    # a cache shared with another CPU: each builds and loads its own library
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    assert c_library.build(source, (), "test", "add").add(2, 3) == 5
    monkeypatch.setattr(c_library, "this_cpu", lambda: c_library.cpu_features(other))
    assert c_library.build(source, (), "test", "add").add(2, 3) == 5
    assert len(list((tmp_path / "cache" / "test").glob("*.so"))) == 2


FAST_MATH_CHILD = """
import sys
from pathlib import Path
from paged_ref.cpu import c_library
before = float(sys.argv[2]) > 0.0
lib = c_library.build(Path(sys.argv[1]), ("-ffast-math",), "test", "add")
print(lib is not None, before, float(sys.argv[2]) > 0.0)
"""


def test_loading_a_fast_math_kernel_keeps_subnormals(source: Path, tmp_path: Path) -> None:
    """The kernels build with -ffast-math; GCC before 13 then links
    crtfastmath.o, whose loading set the FTZ/DAZ bits of the loading thread:
    5e-324 read as 0 from then on (the server refused it as a
    repetition_penalty). The link leaves the flag out. In a child process:
    a failure here would leave the bits set in the test process."""
    env = {**os.environ, "PAGED_CACHE_DIR": str(tmp_path / "cache")}
    child = subprocess.run(
        [sys.executable, "-c", FAST_MATH_CHILD, str(source), "5e-324"], capture_output=True,
        text=True, env=env, timeout=120,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-1000:]
    assert child.stdout.split() == ["True", "True", "True"], child.stdout
