#!/usr/bin/env bash
# The quantized GEMM on a CUDA machine in one go (about 2-3 minutes on an
# H100): its differential tests on the GPU, then its benchmark, then the
# benchmark's table (both paths at every M, and where dense starts to win). Needs only torch, triton, pytest and pytest-benchmark
# (the packages run from their source folders, nothing is installed).
# Run from anywhere:  bash benchmarks/quant_matmul_gpu_check.sh
# The JSON and the benchmark's log land in $OUT (else /tmp): quant_bench.json/.log.
set -euo pipefail
cd "$(dirname "$0")/.."
src=packages/paged-core/src:packages/paged-ref/src:packages/paged-triton/src:packages/paged-server/src
export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}" PYTHONHASHSEED=0 PAGED_TEST_BACKEND=triton
dir="${OUT:-/tmp}"
json="$dir/quant_bench.json" log="$dir/quant_bench.log"
tests=0  # a failing test still lets the benchmark run; the script fails at the end
python -m pytest tests/triton/test_quant_matmul.py -q -p no:randomly -p no:cacheprovider || tests=$?
if ! python -m pytest benchmarks/test_quant_matmul_bench.py --benchmark-only -q -p no:randomly \
    -p no:cacheprovider --benchmark-json="$json" >"$log" 2>&1; then
    tail -80 "$log"
    exit 1
fi
tail -1 "$log"
[ -f "$json" ] || { echo "no benchmark JSON: the benchmark needs CUDA"; exit 1; }
python - "$json" <<'PY'
import json, sys
rows = [b["extra_info"] for b in json.load(open(sys.argv[1]))["benchmarks"]]
if not rows:
    sys.exit("no benchmark rows: the benchmark needs CUDA")
print(rows[0].get("device", ""), "| GPU ms per call in a CUDA graph over cold weights:",
      "kernel = quant_matmul forced at every M, dense = one-pass Triton dequantize + cuBLAS",
      "forced at every M, torch deq = dequantized_weight() + cuBLAS (the fallback), layer =",
      "the path the layer picks (DENSE_ROWS); eager: do_bench of the eager layer call",
      "(L2 flushed); host/launch: host us per call")
head = ("case", "kernel", "dense", "torch deq", "bf16", "path", "best", "layer", "x bf16",
        "GB/s", "eager", "host", "launch", "splits")
print(f"{head[0]:<46}" + "".join(f"{h:>10}" for h in head[1:]))
for r in rows:
    if "kernel_ms" not in r:
        continue
    cells = (f"{r['kernel_ms']:.4f}", f"{r['dense_ms']:.4f}", f"{r['torch_dense_ms']:.4f}",
             f"{r['bf16_ms']:.4f}", r["path"], r["best"], f"{r['layer_ms']:.4f}",
             f"{r['speedup_vs_bf16']:.2f}", f"{r['GBps']:.0f}", f"{r['eager_ms']:.4f}",
             f"{r['host_us']:.0f}", f"{r['launch_us']:.0f}", r["splits"])
    print(f"{r['case']:<46}" + "".join(f"{c:>10}" for c in cells))
# Where dense starts to win, per format and shape: what DENSE_ROWS should be.
cross = {}
for r in rows:
    if "kernel_ms" in r:
        key = r["case"].rsplit(" M=", 1)[0]
        cross.setdefault(key, [])
        if r["best"] == "dense":
            cross[key].append(r["m"])
print("\nsmallest M where dense beats the kernel (layer switches at DENSE_ROWS):")
for key, ms in cross.items():
    print(f"  {key:<40} {min(ms) if ms else 'never'}")
print("\nsplit-K at decode (GPU ms per call by split width; chosen = quant_matmul.split_k)")
for r in rows:
    if "split_ms" in r:
        widths = "  ".join(f"{s}:{ms:.4f}" for s, ms in r["split_ms"].items())
        print(f"{r['case']:<42} {widths}  chosen {r['chosen_splits']} best {r['best_splits']}")
PY
exit "$tests"
