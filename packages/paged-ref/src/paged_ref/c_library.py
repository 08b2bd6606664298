"""Small C kernels for a CPU, built on first use and loaded with ctypes.

A source is compiled with the C compiler ``torch.compile`` uses on a CPU
(``CC``, else ``cc``/``gcc``) and ``-march=native``, with OpenMP: the
library shares torch's OpenMP runtime, so it adds no thread pool. The
build lands in ``~/.cache/paged/<subdir>`` (``PAGED_CACHE_DIR``), named by a
hash of the source and the command, and is written atomically: replicas and
ranks may build at once. A build that fails (no compiler, a CPU without the
instructions the source uses) gives None, and the caller keeps its
reference path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

HEADER = Path(__file__).with_name("bf16.h")

# this folder holds bf16.h, which every kernel may include
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", f"-I{Path(__file__).parent}")


def cache_dir(subdir: str) -> Path:
    return Path(os.environ.get("PAGED_CACHE_DIR", Path.home() / ".cache" / "paged")) / subdir


def compiler() -> str | None:
    """The C compiler inductor would use (``CC``, else ``cc``/``gcc``), or None."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def build(source: Path, flags: Sequence[str], subdir: str, name: str) -> ctypes.CDLL | None:
    """``source`` compiled with ``FLAGS`` and ``flags`` into
    ``cache_dir(subdir)/<name>-<hash>.so`` (once) and loaded; None, with a
    warning, where it cannot be built."""
    cc = compiler()
    if cc is None:
        return None
    command = [cc, *FLAGS, *flags]
    text = source.read_text() + HEADER.read_text() + " ".join(command)
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = cache_dir(subdir) / f"{name}-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            subprocess.run([*command, str(source), "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
            os.replace(tmp, path)  # atomic: a concurrent build writes the same bytes
        except subprocess.CalledProcessError as err:
            os.unlink(tmp)
            log.warning("%s did not build (%s); using the reference path", source.name, err.stderr[-500:])
            return None
    return ctypes.CDLL(str(path))
