#!/usr/bin/env bash
# The server's pure-Python dependencies (and pydantic's and llguidance's
# compiled cores) as CPython 3.12 x86-64 wheels in .whl/, for a GPU image
# that has torch, triton and transformers but no network: carry .whl and
# start the run with benchmarks/gpu_session.sh, which installs them. The
# versions are this checkout's test environment's (the image's own
# transformers, tokenizers, numpy, ... stay). Run here, where pip reaches a
# registry; .whl/ is git-ignored.
# Usage: bash benchmarks/gpu_wheels.sh [PYTHON]   (default: .nox/test/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-.nox/test/bin/python}"
names=(fastapi starlette pydantic pydantic_core annotated-types typing-inspection uvicorn
       llguidance gguf typing_extensions opentelemetry-api)
pins=()
for name in "${names[@]}"; do
    version=$("$py" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$version" ] || { echo "$name is not installed in $py's environment"; exit 1; }
    pins+=("$name==$version")
done
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
rm -rf .whl && mkdir .whl
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
ls .whl
