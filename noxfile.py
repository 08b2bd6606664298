"""Developer and CI entry points: ``nox -s test``, ``lint``, ``typecheck``, ``bench``, ``serve``.

Every session installs the four packages (editable) with torch pinned by
``constraints.txt`` so CPU machines get the CPU build.
"""

from __future__ import annotations

import os

import nox

nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["test"]

PACKAGES = ["packages/paged-core", "packages/paged-ref", "packages/paged-triton", "packages/paged-server"]
TEST_DEPS = [
    "pytest>=8",
    "pytest-benchmark>=4",
    "pytest-timeout>=2",
    "hypothesis>=6",
    "httpx>=0.27",
    "openai>=1.30",
    "schemathesis>=3",
    "matplotlib>=3.8",
]
BACKENDS = ("ref", "triton")


def _install(session: nox.Session, *extra: str) -> None:
    session.install("-c", "constraints.txt", *[f"-e{p}" for p in PACKAGES], *extra)


def _backend_env(session: nox.Session) -> dict[str, str]:
    """Run the Triton kernels in Triton's CPU interpreter unless a GPU is there."""
    out = session.run(
        "python", "-c", "import torch; print(torch.cuda.is_available())", silent=True
    )
    env = {"PYTHONHASHSEED": "0"}
    if "True" not in str(out):
        env["TRITON_INTERPRET"] = "1"
    return env


@nox.session
def test(session: nox.Session) -> None:
    """The whole suite on the `ref` attention backend, then the backend-marked
    tests again on `triton` (interpreter on CPU). `nox -s test -- --backend=ref`
    runs one backend; other arguments go to pytest."""
    _install(session, *TEST_DEPS)
    args = list(session.posargs)
    backends = list(BACKENDS)
    for arg in list(args):
        if arg.startswith("--backend="):
            backends = [arg.split("=", 1)[1]]
            args.remove(arg)
    env = _backend_env(session)
    for backend in backends:
        marker = [] if backend == "ref" else ["-m", "backend"]
        session.log(f"attention backend: {backend}")
        session.run("pytest", *marker, *args, env={**env, "PAGED_TEST_BACKEND": backend})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree."""
    session.install("ruff>=0.5")
    session.run("ruff", "check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over all four packages."""
    _install(session, "mypy>=1.10")
    session.run(
        "mypy",
        "packages/paged-core/src/paged_core",
        "packages/paged-ref/src/paged_ref",
        "packages/paged-triton/src/paged_triton",
        "packages/paged-server/src/paged_server",
    )


@nox.session
def bench(session: nox.Session) -> None:
    """Kernel microbenchmarks (pytest-benchmark) and the engine benchmarks;
    writes benchmarks/results/*.json and regenerates docs/benchmarks.md."""
    _install(session, *TEST_DEPS)
    env = _backend_env(session)
    session.run("pytest", "benchmarks", "--benchmark-only", "-p", "no:randomly",
                "--benchmark-json=benchmarks/results/microbench.json", *session.posargs, env=env)
    if os.path.exists("benchmarks/run_all.py"):
        session.run("python", "benchmarks/run_all.py", env=env)


@nox.session
def serve(session: nox.Session) -> None:
    """Start the OpenAI-compatible server on the embedded default model
    (arguments after `--` go to `paged-server serve`)."""
    _install(session)
    session.run("paged-server", "serve", *session.posargs, env=_backend_env(session))
