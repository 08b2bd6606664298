#!/usr/bin/env bash
# benchmarks/gpu_serving.py (issue 59) on a GPU machine without network, beside
# gpu_steps_offline.sh: the packages run from their source folders with the
# Python that already has torch, triton and transformers. One prepared run,
# each phase under its own time limit (about 8 minutes in all on an H100/H200,
# start-up included): writes benchmarks/results/gpu_serving.json, and a copy
# with the log to $OUT (else /tmp/gpu-serving). Exit status 1 when a phase
# did not finish.
# Usage: bash benchmarks/gpu_serving_offline.sh [--phases llm serve ...]
set -uo pipefail
cd "$(dirname "$0")/.."
src=packages/paged-core/src:packages/paged-ref/src:packages/paged-triton/src:packages/paged-server/src
export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}" PYTHONHASHSEED=0 PYTHONUNBUFFERED=1
dir="${OUT:-/tmp/gpu-serving}"
mkdir -p "$dir"
timeout 540 python benchmarks/gpu_serving.py "$@" 2>&1 | tee "$dir/gpu-serving.log" | grep -v "it/s]"
status=${PIPESTATUS[0]}
cp benchmarks/results/gpu_serving.json "$dir/" 2>/dev/null
exit "$status"
