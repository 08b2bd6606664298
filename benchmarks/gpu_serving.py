"""The GPU path end to end, in one prepared run: an 8B-shaped model served and
measured against the roofline and transformers (issue 59).

    python benchmarks/gpu_serving.py            # a CUDA GPU: ~6-8 minutes, writes
                                                # benchmarks/results/gpu_serving.json
    python benchmarks/gpu_serving.py --tiny     # anywhere (CI on CPU): a tiny model,
                                                # same phases, numbers that are not GPU numbers

Phases, each in its own process (so each gets the whole GPU, and a hang or
crash costs only its own time limit) and each writing its part of the JSON as
it goes:

1. ``checkpoint``: random Llama-3.1-8B-shaped bf16 weights made on the device
   and written once as a checkpoint directory (config.json, safetensors
   shards, the embedded model's tokenizer: nothing is downloaded).
2. ``llm``: the device's HBM bandwidth (a copy kernel), the Triton prefill
   kernel against torch's SDPA on Llama 3.1 8B's attention shapes, then
   ``LLM`` with a GPU user's defaults (Triton attention, CUDA graphs, KV sized
   from free memory, prefix caching, chunked prefill): decode tokens/s at
   1/16/64/256 streams against the HBM roofline (weight + KV bytes per step
   over the measured bandwidth; each stream count's prompts run cold, then
   again as prefix hits, where all the streams decode together), TTFT of 2k-token prompts against the FLOP
   roofline, and the same requests' total throughput.
3. ``serve``: ``paged-server serve`` on the checkpoint, streamed completions
   over HTTP (TTFT, tokens/s, a prefix-cache hit's TTFT).
4. ``hf_batch`` / ``hf_static``: transformers on the same device and weights:
   ``generate_batch``'s continuous batching on the same requests, and
   static-cache ``generate`` for one stream's TTFT and inter-token latency.

``PAGED_PEAK_TFLOPS`` overrides the device's dense bf16 peak (the FLOP roofline).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_serving_phases import PHASES, Shape  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_serving.json"
NOT_GPU = "not GPU numbers: a tiny model on {device}; the run checks the script, not the speed"
# Seconds each phase may take on a GPU (the whole run: under 8 minutes with start-up).
GPU_LIMITS = {"checkpoint": 75, "llm": 170, "serve": 75, "hf_batch": 75, "hf_static": 90}
TINY_LIMIT = 120  # each phase on a CPU (the test's run takes ~30 s in all)

# Llama 3.1 8B's shape; tiny: the same family, small enough for CI's CPU.
LLAMA_8B = Shape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128,
                 vocab=128256, streams=(1, 16, 64, 256), context=1024, new_tokens=64,
                 ttft_prompt=2048, ttft_repeats=3)  # fmt: skip
TINY = Shape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16,
             vocab=8192, streams=(1, 2), context=32, new_tokens=4, ttft_prompt=64,
             ttft_repeats=1)  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every phase in turn, each under its time limit; the merged results."""
    import torch

    cuda = torch.cuda.is_available()
    tiny = args.tiny or not cuda
    shape = TINY if tiny else LLAMA_8B
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    result: dict[str, Any] = {
        "device": "cuda" if cuda else "cpu",  # named by the first phase (no CUDA context here)
        "gpu_numbers": not tiny,
        "note": None if not tiny else NOT_GPU.format(device="cuda" if cuda else "cpu"),
        "model": shape.describe(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "torch": torch.__version__,
        "phases": {},
    }
    if tiny:
        print(result["note"], flush=True)
    for phase in args.phases:
        limit = TINY_LIMIT if tiny else GPU_LIMITS[phase]
        t0 = time.perf_counter()
        status = _run_phase(phase, work, tiny, limit)
        part = _read(work / f"{phase}.json")
        result["phases"][phase] = {"status": status, "seconds": round(time.perf_counter() - t0, 1)}
        result.update(part)
        print(f"[{phase}] {status} in {result['phases'][phase]['seconds']} s", flush=True)
    result.update(summary(result, shape))
    result["seconds"] = round(time.time() - started, 1)
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return result


def _run_phase(phase: str, work: Path, tiny: bool, limit: float) -> str:
    import torch

    cmd = [sys.executable, __file__, "--phase", phase, "--work-dir", str(work)]
    cmd += ["--tiny"] if tiny else []
    try:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if not torch.cuda.is_available():
            env["TRITON_INTERPRET"] = "1"  # the Triton kernels in the CPU interpreter
        proc = subprocess.run(cmd, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        return f"stopped at its {limit} s limit (what it measured before is kept)"
    return "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode}; see its output above)"


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def summary(r: dict[str, Any], shape: Shape) -> dict[str, Any]:
    """The issue's headline fields, from what the phases measured."""
    decode = r.get("decode", {})
    hf = r.get("hf_generate_batch", {})
    ours_ttft = r.get("ttft_2k", {}).get("p50_ms")
    hf_ttft = r.get("hf_static", {}).get("ttft_ms")
    return {
        "decode_roofline_fraction": {s: d["roofline_fraction"] for s, d in decode.items()},
        "vs_transformers_generate_batch": {
            s: d["output_tokens_per_s"] / hf[s]["output_tokens_per_s"]
            for s, d in decode.items() if s in hf and hf[s].get("output_tokens_per_s")
        },
        "ttft_vs_transformers_static": (
            ours_ttft / hf_ttft if ours_ttft and hf_ttft else None
        ),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (automatic without CUDA)")
    parser.add_argument("--out", help=f"the JSON (default: {DEFAULT_OUT.relative_to(ROOT)} on a "
                        "GPU, WORK_DIR/gpu_serving.json with --tiny)")  # fmt: skip
    parser.add_argument("--work-dir", default="/tmp/paged-gpu-serving",
                        help="the checkpoint and each phase's partial results")  # fmt: skip
    parser.add_argument("--phase", choices=list(PHASES), help=argparse.SUPPRESS)
    parser.add_argument("--phases", nargs="+", choices=list(PHASES), default=list(PHASES),
                        help="run only these phases (the checkpoint must exist)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.phase:  # a child process: one phase
        import torch

        tiny = args.tiny or not torch.cuda.is_available()
        PHASES[args.phase](Path(args.work_dir), TINY if tiny else LLAMA_8B, tiny)
        return 0
    result = run(args)
    tiny = not result["gpu_numbers"]
    out = Path(args.out) if args.out else (Path(args.work_dir) / "gpu_serving.json" if tiny else DEFAULT_OUT)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if not tiny:  # GPU numbers: the benchmark page's section comes from this very file
        from report import write_page

        write_page(out.parent, ROOT / "docs")
    print(json.dumps({k: result[k] for k in ("device", "note", "decode_roofline_fraction",
                      "prefill_kernel_vs_sdpa", "vs_transformers_generate_batch",
                      "ttft_vs_transformers_static", "seconds") if k in result}, indent=1))  # fmt: skip
    print(f"wrote {out}")
    failed = [p for p, s in result["phases"].items() if s["status"] != "ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
