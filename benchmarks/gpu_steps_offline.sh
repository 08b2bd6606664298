#!/usr/bin/env bash
# `nox -s gpu`'s four steps for a GPU machine without network, where nox
# cannot build its environment: the packages run from their source folders
# with the Python that already has torch and triton, so only the server's
# pure-Python dependencies need to be there (carried as wheels, say).
#   1. the `cuda`-marked tests, one at a time (each engine sizes its KV pool
#      from the GPU's free memory, so they must not share the GPU);
#   2. tests/triton on the GPU (in parallel with pytest-xdist when present);
#   3. the kernel benchmarks;
#   4. benchmarks/gpu_report.py -> benchmarks/results/gpu.json and gpu.md.
# Logs and the raw files land in $OUT (else /tmp/gpu-steps). Exit status: 1
# when a test failed or a step did not finish.
# Usage: bash benchmarks/gpu_steps_offline.sh [-n WORKERS]
set -uo pipefail
cd "$(dirname "$0")/.."
src=packages/paged-core/src:packages/paged-ref/src:packages/paged-triton/src:packages/paged-server/src
export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}" PYTHONHASHSEED=0 PAGED_TEST_BACKEND=triton
export PYTHONUNBUFFERED=1
dir="${OUT:-/tmp/gpu-steps}"
mkdir -p "$dir"
workers=()
if [ "${1:-}" = "-n" ] && python -c "import xdist" 2>/dev/null; then workers=(-n "$2"); fi
py=(python -m pytest -p no:randomly -p no:cacheprovider -q)
status=0
# tests/e2e holds no cuda-marked test, and its imports (schemathesis, ...) are
# what an offline GPU image is most likely to lack.
"${py[@]}" tests -m cuda --ignore=tests/e2e --junitxml="$dir/gpu-cuda-tests.xml" 2>&1 | tee "$dir/cuda-tests.log" | tail -15
"${py[@]}" tests/triton -m "not cuda" --deselect tests/triton/test_compile_matrix.py "${workers[@]}" \
    --junitxml="$dir/gpu-triton-tests.xml" >"$dir/triton-tests.log" 2>&1
tail -15 "$dir/triton-tests.log"
"${py[@]}" benchmarks/test_decode_attention_bench.py benchmarks/test_prefill_attention_bench.py \
    benchmarks/test_quant_matmul_bench.py --benchmark-only --benchmark-json="$dir/gpu-kernels.json" \
    >"$dir/bench.log" 2>&1 || { tail -40 "$dir/bench.log"; status=1; }
python benchmarks/gpu_report.py --junit "$dir/gpu-cuda-tests.xml" "$dir/gpu-triton-tests.xml" \
    --bench "$dir/gpu-kernels.json" || status=1
cp benchmarks/results/gpu.json benchmarks/results/gpu.md "$dir/" 2>/dev/null
failed=$(python -c "import json; print(json.load(open('benchmarks/results/gpu.json'))['tests']['failed'])")
[ "$failed" = "0" ] || { echo "$failed GPU test(s) failed: see gpu.md"; status=1; }
exit "$status"
