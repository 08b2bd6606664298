"""Developer and CI entry points: ``nox -s test``, ``lint``, ``typecheck``, ``bench``, ``gpu``, ``serve``.

Every session installs the four packages (editable) with torch pinned by
``constraints.txt`` so CPU machines get the CPU build.
"""

from __future__ import annotations

import os
import shutil

import nox

nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["test"]

PACKAGES = ["packages/paged-core", "packages/paged-ref", "packages/paged-triton", "packages/paged-server"]
TEST_DEPS = [
    "pytest>=8",
    "pytest-benchmark>=4",
    "pytest-timeout>=2",
    "pytest-xdist>=3",  # `nox -s test` runs the suite on two workers (XDIST below)
    "hypothesis>=6",
    "httpx>=0.27",
    "openai>=1.30",
    "anthropic>=0.40",  # tests/e2e/test_messages_api.py: Anthropic's own client against /v1/messages
    "schemathesis>=3",
    "matplotlib>=3.8",
    "lm_eval[api]>=0.4.9",  # tests/e2e/test_lm_eval.py: local-completions against the server
    "jsonschema>=4",
    "sentencepiece>=0.1.98",  # llama.cpp's convert_hf_to_gguf.py imports it (benchmarks/llamacpp_peer.py)
    "compressed-tensors>=0.20",  # tests/server/models/test_quantized_checkpoints.py writes its checkpoints
    "peft>=0.13",  # tests/server/models/test_lora.py: adapters made and merged by peft (the oracle)
    # tests/e2e/test_chat_page.py drives the system's Chromium (.ci/run installs it); the
    # package brings its driver and downloads no browser
    "playwright>=1.40",
    # tests/e2e/test_guidellm.py: vLLM's benchmark client against `serve`; pinned, its CLI
    # changes between releases (torch stays the constraints.txt CPU build)
    "guidellm==0.8.1",
]
BACKENDS = ("ref", "triton")
# Two workers, each test file on one (its module fixtures built once): the
# suite took 27 minutes on one of a CI machine's two cores and 16.5 on both.
# `nox -s test -- -n 0` runs it in one process. Tests marked `serial` compare
# timings, which the other worker's load would skew: they run alone after.
XDIST = ["-n", "2", "--dist", "loadfile"]


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
        chosen = "" if backend == "ref" else "backend and "
        session.log(f"attention backend: {backend}")
        run_env = {**env, "PAGED_TEST_BACKEND": backend}
        session.run("pytest", *XDIST, "-m", f"{chosen}not serial", *args, env=run_env)
        # exit 5: no serial test among those chosen (the triton pass has none)
        session.run("pytest", "-m", f"{chosen}serial", *args, env=run_env, success_codes=[0, 5])


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
def gpu(session: nox.Session) -> None:
    """On a CUDA machine: the `cuda`-marked tests and the Triton differential
    tests on the GPU (bf16 included), the kernel benchmarks (attention:
    do_bench, L2 flushed; the quantized GEMM: CUDA graphs over cold weight
    copies), then benchmarks/results/gpu.json
    and gpu.md, then the end-to-end serving run (benchmarks/gpu_serving.py ->
    gpu_serving.json). Without CUDA it
    says so in one line and stops. Arguments after `--` go to both pytest runs."""
    if shutil.which("nvidia-smi") is None:
        session.skip("no NVIDIA GPU here (nvidia-smi not found); nox -s gpu needs one")
    _install(session, *TEST_DEPS)
    probe = session.run(
        "python", "-c", "import torch; print(torch.cuda.is_available())", silent=True
    )
    if "True" not in str(probe):
        session.skip("no CUDA GPU here (torch.cuda.is_available() is False); nox -s gpu needs one")
    tmp = session.create_tmp()
    env = {"PYTHONHASHSEED": "0", "PAGED_TEST_BACKEND": "triton"}
    junit = [f"{tmp}/gpu-cuda-tests.xml", f"{tmp}/gpu-triton-tests.xml"]
    session.run("pytest", "tests", "-m", "cuda", "-p", "no:randomly", f"--junitxml={junit[0]}",
                *session.posargs, env=env, success_codes=[0, 1, 5])  # fmt: skip
    session.run("pytest", "tests/triton", "-m", "not cuda", "-p", "no:randomly",
                "--deselect", "tests/triton/test_compile_matrix.py", f"--junitxml={junit[1]}",
                *session.posargs, env=env, success_codes=[0, 1])  # fmt: skip
    bench = f"{tmp}/gpu-kernels.json"
    session.run("pytest", "benchmarks/test_decode_attention_bench.py",
                "benchmarks/test_prefill_attention_bench.py", "benchmarks/test_quant_matmul_bench.py",
                "--benchmark-only", "-p", "no:randomly",
                f"--benchmark-json={bench}", *session.posargs, env=env)  # fmt: skip
    session.run("python", "benchmarks/gpu_report.py", "--junit", *junit, "--bench", bench)
    failed = session.run(
        "python", "-c",
        "import json; print(json.load(open('benchmarks/results/gpu.json'))['tests']['failed'])",
        silent=True,
    )  # fmt: skip
    # The end-to-end run (issue 59): an 8B-shaped model served, against the roofline and
    # transformers; each phase under its own time limit, ~8 minutes in all.
    session.run("python", "benchmarks/gpu_serving.py", env=env, success_codes=[0, 1])
    if str(failed).strip() != "0":
        session.error(f"{str(failed).strip()} GPU test(s) failed: see benchmarks/results/gpu.md")
    unfinished = session.run(
        "python", "-c",
        "import json; r = json.load(open('benchmarks/results/gpu_serving.json'));"
        "print(' '.join(p for p, s in r['phases'].items() if s['status'] != 'ok'))",
        silent=True,
    )  # fmt: skip
    if str(unfinished).strip():
        session.error(f"gpu_serving.py phases not finished: {str(unfinished).strip()} "
                      "(see benchmarks/results/gpu_serving.json)")  # fmt: skip


@nox.session
def serve(session: nox.Session) -> None:
    """Start the OpenAI-compatible server on the embedded default model
    (arguments after `--` go to `paged-server serve`)."""
    _install(session)
    session.run("paged-server", "serve", *session.posargs, env=_backend_env(session))
