"""Summarise a ``nox -s gpu`` run: benchmarks/results/gpu.json and gpu.md.

Reads the junit XML files of the GPU test runs and the pytest-benchmark JSON
of the kernel benchmarks, compiles the core kernel matrix for this GPU's
own architecture (CI covers sm_80/sm_89/sm_90; this one may be another),
and writes one JSON (device, versions, test outcomes with failures named,
every benchmark's measurements, the issue's targets evaluated, the compile
data) and a markdown page of the same. Every number is one the
run measured; a target whose case did not run is reported as missing.

Usage: ``python benchmarks/gpu_report.py --junit a.xml [b.xml ...] --bench kernels.json``
"""

from __future__ import annotations

import argparse
import json
import platform
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def read_junit(paths: list[Path]) -> dict[str, Any]:
    """Counts and the names of failed tests over all junit files."""
    out: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for path in paths:
        if not path.is_file():
            out["failures"].append(f"{path.name}: no junit file (the test run did not finish)")
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            if case.find("failure") is not None or case.find("error") is not None:
                out["failed"] += 1
                out["failures"].append(name)
            elif case.find("skipped") is not None:
                out["skipped"] += 1
            else:
                out["passed"] += 1
    return out


def read_bench(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Machine info and one row per benchmark (its extra_info and mean)."""
    if not path.is_file():
        return {}, []
    data = json.loads(path.read_text(encoding="utf-8"))
    rows = []
    for b in data.get("benchmarks", []):
        rows.append({"name": b["name"], "group": b.get("group"), **b.get("extra_info", {}),
                     "wall_mean_ms": 1e3 * b["stats"]["mean"]})  # fmt: skip
    return data.get("machine_info", {}), rows


def _case(rows: list[dict[str, Any]], case: str) -> dict[str, Any] | None:
    return next(
        (r for r in rows if r.get("case") == case and r.get("group") != "split policy"), None
    )


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's GPU targets, each with its measured value (or missing);
    interpreter rows (no CUDA) never count."""
    host = next((r for r in rows if "us_per_call" in r and r["device"].startswith("cuda")), None)
    rows = [r for r in rows if str(r.get("timing", "")).startswith("do_bench")]
    out = []
    uniform = _case(rows, "uniform-64x4k")
    out.append({
        "target": "bf16 decode, batch 64 x 4,096 tokens: >= 70% of peak HBM bandwidth",
        "value": None if uniform is None else uniform.get("pct_of_peak"),
        "unit": "% of peak",
        "met": None if uniform is None or uniform.get("pct_of_peak") is None
        else uniform["pct_of_peak"] >= 70,
    })  # fmt: skip
    ragged, same = _case(rows, "ragged-1x32k+63x1k"), _case(rows, "uniform-64x1520")
    ratio = None if ragged is None or same is None else ragged["kernel_ms"] / same["kernel_ms"]
    out.append({
        "target": "ragged batch (1 x 32k + 63 x 1k) within 1.3x of the uniform batch of the same tokens",
        "value": ratio, "unit": "x", "met": None if ratio is None else ratio <= 1.3,
    })  # fmt: skip
    out.append({
        "target": "host time per decode call (wrapper + launch, no-op kernel) <= 10 us",
        "value": None if host is None else host["us_per_call"], "unit": "us",
        "met": None if host is None else host["us_per_call"] <= 10,
    })  # fmt: skip
    return out


def compile_here() -> dict[str, Any]:
    """The core compile matrix for this GPU's compute capability."""
    import torch

    from paged_triton import compile_matrix as cm

    missing = cm.tools_missing()
    if missing or not torch.cuda.is_available():
        return {"skipped": missing or "no CUDA device"}
    major, minor = torch.cuda.get_device_capability()
    results = cm.run(cm.core_variants(), archs=[10 * major + minor])
    return {
        "arch": f"sm_{10 * major + minor}",
        "compiles": len(results),
        "problems": [f"{r.job.label}: {'; '.join(r.problems)}" for r in results if r.problems],
        "rows": [r.row() for r in results],
    }


def _num(row: dict[str, Any], key: str, scale: float = 1.0, digits: int = 1) -> str:
    value = row.get(key)
    return "-" if value is None else f"{value * scale:,.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    t = report["tests"]
    lines = [
        "# GPU run (`nox -s gpu`)",
        "",
        f"Device: {report['device']}; torch {report['torch']}, triton {report['triton']}; "
        f"{report['host']}.",
        "",
        f"Tests (cuda-marked + tests/triton on the GPU): {t['passed']} passed, "
        f"{t['failed']} failed, {t['skipped']} skipped.",
    ]
    lines += [f"- FAILED {name}" for name in t["failures"]]
    lines += ["", "## Targets", "", "| target | measured | met |", "|---|---:|---|"]
    for target in report["targets"]:
        value = "not run" if target["value"] is None else f"{target['value']:.3g} {target['unit']}"
        met = {True: "yes", False: "no", None: "-"}[target["met"]]
        lines.append(f"| {target['target']} | {value} | {met} |")
    lines += [
        "",
        "## Kernel benchmarks",
        "",
        "`kernel_ms`: `triton.testing.do_bench`, L2 flushed before each timed call.",
        "",
        "| group | case | impl | kernel ms | GB/s | % of peak | TFLOP/s | working set MB |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["benchmarks"]:
        if "kernel_ms" not in r or "speedup_vs_bf16" in r:  # the quantized GEMM: its own table
            continue
        case = r.get("case", r["name"])
        if "waves_per_sm" in r:
            case += f" (split target {r['waves_per_sm']} programs/SM)"
        lines.append(
            f"| {r['group']} | {case} | {r.get('impl', '-')} | {_num(r, 'kernel_ms', digits=3)} | "
            f"{_num(r, 'kv_GBps' if 'kv_GBps' in r else 'GBps')} | {_num(r, 'pct_of_peak')} | "
            f"{_num(r, 'TFLOPs')} | "
            f"{_num(r, 'working_set_bytes', 1e-6, 0)} |"
        )
    quant = [r for r in report["benchmarks"] if "speedup_vs_bf16" in r]
    if quant:
        lines += [
            "",
            "## Quantized GEMM (weight-only, bf16 activations)",
            "",
            "Each row one run, side by side, GPU ms per call in a CUDA graph over cold "
            "weight copies: the Triton kernel and the dense path (one-pass dequantize, then "
            "cuBLAS), each forced at every M, the fallback's tensor-op dequantize + cuBLAS, "
            "and the 16-bit matmul; the path the layer takes at this M and its speed against "
            "bf16; the eager layer call (do_bench) and its host microseconds.",
            "",
            "| case | triton ms | dense ms | torch deq ms | bf16 ms | path | best "
            "| layer x vs bf16 | weight GB/s | eager ms | host us |",
            "|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
        ]
        for r in quant:
            lines.append(
                f"| {r['case']} | {_num(r, 'kernel_ms', digits=4)} | "
                f"{_num(r, 'dense_ms', digits=4)} | {_num(r, 'torch_dense_ms', digits=4)} | "
                f"{_num(r, 'bf16_ms', digits=4)} | {r.get('path', '-')} | {r.get('best', '-')} | "
                f"{_num(r, 'speedup_vs_bf16', digits=2)} | {_num(r, 'GBps')} | "
                f"{_num(r, 'eager_ms', digits=4)} | {_num(r, 'host_us', digits=0)} |"
            )
    host = [r for r in report["benchmarks"] if "us_per_call" in r]
    for r in host:
        lines += ["", f"Host overhead: {r['us_per_call']:.1f} us per call ({r['measures']})."]
    matrix = report["compile_matrix"]
    lines += ["", "## Compile matrix for this GPU", ""]
    if "skipped" in matrix:
        lines.append(f"Skipped: {matrix['skipped']}.")
    else:
        lines.append(
            f"{matrix['compiles']} core variants compiled for {matrix['arch']}: "
            f"{len(matrix['problems'])} with problems (spills, shared memory, single-buffered K/V)."
        )
        lines += [f"- {p}" for p in matrix["problems"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Write gpu.json and gpu.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit", type=Path, nargs="*", default=[])
    parser.add_argument("--bench", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    import torch
    import triton

    machine, rows = read_bench(args.bench)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    report = {
        "device": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "host": f"{platform.node()} ({machine.get('cpu', {}).get('brand_raw', platform.machine())})",
        "tests": read_junit(args.junit),
        "targets": targets(rows),
        "benchmarks": rows,
        "compile_matrix": compile_here(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (args.out / "gpu.md").write_text(markdown(report), encoding="utf-8")
    print(f"wrote {args.out / 'gpu.json'} and {args.out / 'gpu.md'}")


if __name__ == "__main__":
    main()
