"""Small C kernels for a CPU, built on first use and loaded with ctypes.

A source is compiled with the C compiler ``torch.compile`` uses on a CPU
(``CC``, else ``cc``/``gcc``) and ``-march=native``, with OpenMP: the
library shares torch's OpenMP runtime, so it adds no thread pool. The
build lands in ``~/.cache/paged/<subdir>`` (``PAGED_CACHE_DIR``), named by a
hash of the source, the command and the CPU (``-march=native`` code may use
instructions another CPU lacks, so a cache shared between machines keeps a
build per CPU). Replicas and ranks may build at once, so a build is
compiled into a temporary file and renamed into place, and then its size
and SHA-256 are written beside it (``.sha256``), also by rename. A library
is loaded only once it matches that record: a truncated file would be
mapped and kill the process with SIGBUS. Anything that fails (no
compiler, a CPU without the instructions the source uses, a cache that is
read-only or not a directory) gives one warning and None, and the caller
keeps its reference path.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

HEADER = Path(__file__).with_name("bf16.h")


def source(name: str) -> Path:
    """A kernel's C file in this folder (``cpu_decode.c``, ``cpu_gemv.c``)."""
    return HEADER.with_name(name)

# this folder holds bf16.h, which every kernel may include
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", f"-I{Path(__file__).parent}")
# The link is a command of its own, without the kernels' flags: GCC before 13
# links crtfastmath.o into a library built with -ffast-math, which sets the
# FTZ/DAZ bits of whichever thread loads it, and from then on that thread
# (and the threads it starts) reads every subnormal double as 0: the server
# refused repetition_penalty=5e-324 as "got 0.0" once a kernel was loaded.
LINK = ("-shared", "-fopenmp")
# /proc/cpuinfo fields that say which instructions -march=native may use (x86, then Arm)
_CPU_FIELDS = ("model name", "flags", "CPU implementer", "CPU part", "Features")

_warned: set[str] = set()


def cache_dir(subdir: str) -> Path:
    return Path(os.environ.get("PAGED_CACHE_DIR", Path.home() / ".cache" / "paged")) / subdir


def compiler() -> str | None:
    """The C compiler inductor would use (``CC``, else ``cc``/``gcc``), or None."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def cpu_features(cpuinfo: str) -> str:
    """The machine and its first processor's model and feature flags, from
    ``/proc/cpuinfo``'s text: what ``-march=native`` compiles for."""
    first = cpuinfo.split("\n\n", 1)[0]
    fields = [
        value.strip()
        for name, _, value in (line.partition(":") for line in first.splitlines())
        if name.strip() in _CPU_FIELDS
    ]
    return "|".join([platform.machine(), *fields])


@functools.cache
def this_cpu() -> str:
    """``cpu_features`` of this machine (the machine name alone without /proc)."""
    try:
        return cpu_features(Path("/proc/cpuinfo").read_text())
    except OSError:
        return cpu_features("")


def cache_key(text: str, command: Sequence[str], cpu: str) -> str:
    """The build's name: a hash of the sources' ``text``, the compile
    ``command`` and the ``cpu`` it runs on."""
    return hashlib.sha256("\0".join([text, " ".join(command), cpu]).encode()).hexdigest()[:16]


def record(library: Path) -> Path:
    """The file holding ``library``'s size and SHA-256."""
    return library.with_name(library.name + ".sha256")


def verified(library: Path) -> bool:
    """Whether ``library`` exists and matches its size and SHA-256 record."""
    try:
        size, digest = record(library).read_text().split()
        data = library.read_bytes()
    except (OSError, ValueError):
        return False
    return len(data) == int(size) and hashlib.sha256(data).hexdigest() == digest


def build(source: Path, flags: Sequence[str], subdir: str, name: str) -> ctypes.CDLL | None:
    """``source`` compiled with ``FLAGS`` and ``flags`` into
    ``cache_dir(subdir)/<name>-<hash>.so`` (once) and loaded; None, with a
    warning, where it cannot be built or loaded."""
    cc = compiler()
    if cc is None:
        return None
    command = [cc, *FLAGS, *flags]
    key = cache_key(source.read_text() + HEADER.read_text(), [*command, *LINK], this_cpu())
    path = cache_dir(subdir) / f"{name}-{key}.so"
    try:
        if not verified(path):
            if path.exists():
                _warn_once(
                    str(path),
                    f"{path} does not match its checksum record (a build cut short or a "
                    "truncated copy); rebuilding it",
                )
            _compile([*command, "-c", str(source)], [cc, *LINK], path)
        return ctypes.CDLL(str(path))
    except subprocess.CalledProcessError as err:
        _warn_once(
            source.name,
            f"{source.name} did not build ({err.stderr[-500:]}); using the reference path",
        )
    except OSError as err:
        _warn_once(
            str(path.parent.parent),
            f"the kernel cache {path.parent} cannot be used ({err}); the C kernels run their "
            "reference path. Set PAGED_CACHE_DIR to a writable directory",
        )
    return None


def _compile(compile_command: list[str], link_command: list[str], path: Path) -> None:
    """Compile to an object, link it into a temporary file (``LINK``), rename
    that to ``path``, then write its record the same way: a reader sees no
    record, or one that matches."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    obj = tmp[: -len(".so")] + ".o"
    try:
        subprocess.run([*compile_command, "-o", obj], check=True, capture_output=True, text=True)
        subprocess.run([*link_command, obj, "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
        data = Path(tmp).read_bytes()
        os.replace(tmp, path)  # atomic: a concurrent build writes the same bytes
    finally:
        for leftover in (tmp, obj):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)
    fd, tmp = tempfile.mkstemp(suffix=".sha256", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{len(data)} {hashlib.sha256(data).hexdigest()}\n")
        os.replace(tmp, record(path))
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _warn_once(key: str, message: str) -> None:
    """One warning per library or cache directory per process."""
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", message)
