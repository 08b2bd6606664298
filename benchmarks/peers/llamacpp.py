"""llama.cpp as a benchmark peer: build ``llama-server``, convert a checkpoint to GGUF, serve it.

Nothing of llama.cpp lives in this repository. Its source is the tree the
``llama-cpp-python`` sdist vendors (``vendor/llama.cpp``), downloaded with
pip and built CPU-only under ``nice`` into the paged cache dir, once:

    ~/.cache/paged/llama.cpp/<sdist version>/llama_cpp_python-<version>/vendor/llama.cpp/build-noamx/bin/llama-server

(``build-noamx``: see ``cmake_flags`` for why ggml's AMX kernels are left out.)

A checkpoint is converted with that tree's own ``convert_hf_to_gguf.py``
(``gguf_convert.py`` runs it), cached next to the build under ``gguf/``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

SDIST = "llama-cpp-python"
BASE_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    # Without these three the configure step tries to download its web UI / TLS.
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
# ggml's AMX kernels (Q4_0/Q4_1/Q8_0/K-quants only; f32/f16/bf16 never use them)
# die with SIGILL under GCC 12: its `_tile_loadconfig` declares an 8-byte memory
# operand, so -O3 deletes the 64-byte tile config's row/column stores as dead,
# `ldtilecfg` loads every tile as 0 x 0, and the first `tilezero` raises #UD
# (upstream: ggml-org/llama.cpp PR 26954, open). `-march=native` turns AMX on
# wherever the CPU has it, and an explicit -mno-* wins over -march whatever the
# order, so these leave every other native extension on (AVX512, VNNI, BF16, FP16)
# and quantized types take ggml's AVX512 repacked kernels instead.
NO_AMX_CFLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# The build folder in the vendored tree: a new name, so a tree built with AMX
# (build/, which cannot serve Q8_0/Q4_0 on an AMX CPU) is never picked up.
BUILD_DIR = "build-noamx"
# Output types convert_hf_to_gguf.py writes itself; the rest go through llama-quantize.
CONVERTER_OUTTYPES = ("f32", "f16", "bf16", "q8_0")
QUANTIZE_OUTTYPES = {"q4_0": "Q4_0", "q4_k_m": "Q4_K_M"}
OUTTYPES = (*CONVERTER_OUTTYPES, *QUANTIZE_OUTTYPES)


def cpu_flags() -> frozenset[str]:
    """The ``flags`` line of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cmake_flags(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The cmake configure flags for this CPU (``flags``: its /proc/cpuinfo
    flags): native, with AMX compiled out where the CPU has it (above)."""
    flags = cpu_flags() if flags is None else flags
    if not flags & {"amx_tile", "amx_int8", "amx_bf16"}:
        return BASE_CMAKE_FLAGS  # -march=native enables no AMX: nothing to turn off
    return (*BASE_CMAKE_FLAGS, f"-DCMAKE_C_FLAGS={NO_AMX_CFLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_CFLAGS}")


def llamacpp_root(cache_dir: str | Path | None = None) -> Path:
    """Where builds and GGUF files are cached (``<paged cache>/llama.cpp``)."""
    from paged_server.default_model import default_cache_dir

    return (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / "llama.cpp"


@dataclass(frozen=True, slots=True)
class LlamaCpp:
    """One built llama.cpp tree."""

    version: str  # the llama-cpp-python sdist's version
    source: Path  # .../vendor/llama.cpp

    @property
    def bin_dir(self) -> Path:
        return self.source / BUILD_DIR / "bin"

    @property
    def server(self) -> Path:
        return self.bin_dir / "llama-server"

    @property
    def quantize(self) -> Path:
        return self.bin_dir / "llama-quantize"

    @property
    def converter(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def find_llamacpp(root: Path | None = None) -> LlamaCpp | None:
    """The newest cached tree whose ``llama-server`` is built, else None."""
    root = root or llamacpp_root()
    found = []
    for server in root.glob(f"*/llama_cpp_python-*/vendor/llama.cpp/{BUILD_DIR}/bin/llama-server"):
        if os.access(server, os.X_OK):
            found.append(LlamaCpp(server.parents[5].name, server.parents[2]))
    return max(found, key=lambda t: _version_key(t.version), default=None)


def missing_message(root: Path | None = None) -> str:
    """What to say when there is no build (the benchmark skips with this)."""
    root = root or llamacpp_root()
    return (
        f"llama.cpp peer skipped: no built llama-server under {root}. Build it once with "
        "`python benchmarks/llamacpp_peer.py --build` (downloads the llama-cpp-python sdist with pip "
        "and compiles vendor/llama.cpp CPU-only: ~15+ minutes on 2 cores)."
    )


def _log(msg: str) -> None:
    print(f"[llamacpp] {msg}", file=sys.stderr, flush=True)


def download_sdist(root: Path) -> Path:
    """The llama-cpp-python sdist, fetched with pip into ``root/dl`` (reused when there)."""
    dl = root / "dl"
    existing = sorted(dl.glob("llama_cpp_python-*.tar.gz"), key=lambda p: _version_key(p.name))
    if existing:
        return existing[-1]
    dl.mkdir(parents=True, exist_ok=True)
    _log(f"pip download {SDIST} (sdist) into {dl}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", str(dl)]
    subprocess.run(cmd, check=True)
    found = sorted(dl.glob("llama_cpp_python-*.tar.gz"), key=lambda p: _version_key(p.name))
    if not found:
        raise RuntimeError(f"pip download left no llama_cpp_python-*.tar.gz in {dl}")
    return found[-1]


# What convert_hf_to_gguf.py needs of the vendored tree (no build): the script last, so
# that a tree whose script is there is whole.
CONVERTER_FILES = ("conversion/", "gguf-py/", "convert_hf_to_gguf.py")


def converter_tree(root: Path | None = None) -> LlamaCpp:
    """A llama.cpp tree to run ``convert_hf_to_gguf.py`` from: the newest
    built one, else the converter's files alone (the script, its
    ``conversion/`` package and ``gguf-py/``) extracted from the sdist,
    which is downloaded once. Nothing is compiled."""
    root = root or llamacpp_root()
    if (built := find_llamacpp(root)) is not None:
        return built
    sdist = download_sdist(root)
    version = sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
    tree = LlamaCpp(version, root / version / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp")
    if tree.converter.is_file():
        return tree
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    _log(f"extracting the converter from {sdist.name}")
    with tarfile.open(sdist) as tar:
        wanted = {
            m.name: m for m in tar.getmembers()
            if m.name.startswith(prefix) and m.name[len(prefix):].startswith(CONVERTER_FILES)
        }  # fmt: skip
        order = sorted(wanted, key=lambda n: n.endswith("convert_hf_to_gguf.py"))
        tar.extractall(root / version, members=[wanted[n] for n in order], filter="data")
    if not tree.converter.is_file():
        raise RuntimeError(f"{sdist.name} holds no {prefix}convert_hf_to_gguf.py")
    return tree


# llama-quantize makes q4_0 / q4_k_m; after llama-server it is one more file to compile.
BUILD_TARGETS = ("llama-server", "llama-quantize")


def build_llamacpp(
    root: Path | None = None, targets: tuple[str, ...] = BUILD_TARGETS, jobs: int = 2
) -> LlamaCpp:
    """Download, extract and build (``nice -n 19``, CPU only) the sdist's
    vendored llama.cpp; a tree whose binaries for ``targets`` exist is reused."""
    root = root or llamacpp_root()
    sdist = download_sdist(root)
    version = sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
    source = root / version / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    tree = LlamaCpp(version, source)
    if all((tree.bin_dir / t).is_file() for t in targets):
        return tree
    if shutil.which("cmake") is None:
        raise FileNotFoundError("building llama.cpp needs cmake and a C++ compiler on PATH (apt-get install cmake g++)")
    if not (source / "CMakeLists.txt").is_file():
        _log(f"extracting {sdist.name}")
        with tarfile.open(sdist) as tar:
            tar.extractall(root / version, filter="data")
    nice = ["nice", "-n", "19"]
    build_dir = source / BUILD_DIR
    if not (build_dir / "CMakeCache.txt").is_file():
        subprocess.run([*nice, "cmake", "-B", str(build_dir), *cmake_flags()], cwd=source, check=True)
    _log(f"building {' '.join(targets)} with {jobs} jobs (slow: ~15+ min on 2 cores)")
    subprocess.run(
        [*nice, "cmake", "--build", str(build_dir), f"-j{jobs}", "--target", *targets],
        cwd=source,
        check=True,
    )
    return tree


def pre_tokenizer_name(model_dir: str | Path) -> str | None:
    """The name llama.cpp knows a tokenizer's pre-tokenizer by, when the
    converter's hash table cannot: byte-level BPE with the GPT-2 regex
    (``ByteLevel``, ``use_regex``) is ``gpt-2``. None: leave it to the converter."""
    path = Path(model_dir, "tokenizer.json")
    if not path.is_file():
        return None
    pre = json.loads(path.read_text(encoding="utf-8")).get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    return None


def gguf_path(model_dir: str | Path, outtype: str, root: Path | None = None) -> Path:
    """Where the GGUF of ``model_dir`` in ``outtype`` is cached."""
    return (root or llamacpp_root()) / "gguf" / Path(model_dir).name / f"{outtype}.gguf"


def convert_to_gguf(
    tree: LlamaCpp, model_dir: str | Path, outtype: str = "f32", root: Path | None = None
) -> Path:
    """``model_dir`` (a HF directory) as GGUF in ``outtype`` (``f32``, ``f16``,
    ``bf16``, ``q8_0`` by the converter; ``q4_0``, ``q4_k_m`` by
    ``llama-quantize`` from the f32 file), cached; returns its path."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
    out = gguf_path(model_dir, outtype, root)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".gguf.tmp")
    if outtype in QUANTIZE_OUTTYPES:
        if not tree.quantize.is_file():
            raise FileNotFoundError(
                f"{outtype} needs {tree.quantize}: build it with "
                "`python benchmarks/llamacpp_peer.py --build --build-only`"
            )
        src = convert_to_gguf(tree, model_dir, "f32", root)
        subprocess.run([str(tree.quantize), str(src), str(tmp), QUANTIZE_OUTTYPES[outtype]], check=True)
    else:
        cmd = [sys.executable, str(Path(__file__).with_name("gguf_convert.py")), str(tree.source), str(model_dir),
               "--outtype", outtype, "--outfile", str(tmp)]  # fmt: skip
        if pre := pre_tokenizer_name(model_dir):
            cmd += ["--pre-tokenizer", pre]
        subprocess.run(cmd, check=True)
    tmp.replace(out)
    return out


def start_llama_server(
    tree: LlamaCpp, gguf: Path, port: int, *, parallel: int, ctx_per_seq: int, threads: int = 2,
    log: Path | None = None, extra: tuple[str, ...] = (),
) -> subprocess.Popen[bytes]:  # fmt: skip
    """``llama-server --parallel N -c N*ctx --cont-batching -t threads`` on
    loopback, then ``extra`` (speculative decoding's flags)."""
    cmd = [
        str(tree.server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "--parallel", str(parallel), "-c", str(parallel * ctx_per_seq), "--cont-batching",
        "-t", str(threads), "-tb", str(threads), *extra,
    ]  # fmt: skip
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def start_paged_server(model_dir: str | Path, port: int, extra: tuple[str, ...] = (),
                       log: Path | None = None) -> subprocess.Popen[bytes]:  # fmt: skip
    """``paged-server serve`` (defaults) in a child process, so its CPU time is its own."""
    cmd = [sys.executable, "-m", "paged_server.entrypoints.cli", "serve", "--model", str(model_dir),
           "--port", str(port), "--log-level", "warning", *extra]  # fmt: skip
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout_s: float = 600.0) -> None:
    """Poll ``/health`` until it answers 200 (llama-server answers 503 while loading)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {proc.args[0]} exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health not ready after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it does not exit."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
