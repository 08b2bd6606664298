"""CPU decode speed of quantized weights against dense ones, side by side.

``python benchmarks/quantized_decode.py [--model DIR] [--rounds 5]``
loads the model once per weight format (float32, bfloat16, ``--quantization``
int8 and int4 by default), then, round after round, runs the same greedy
decode through each engine in turn (alternating, so machine noise hits all
alike) at each concurrency, and reports median decode tokens/s and the
ratio to float32 and to bfloat16. Only decode steps are timed (the first
step, which prefills, is not). Prints one JSON line per format and
concurrency, then a table. Each row says how the engine ran: ``forward``
compiled (serving's default on CPU) or eager (``PAGED_COMPILE=0``, as the
test suite sets, or ``--enforce-eager``), and the activation dtype (``auto``
is bfloat16 only on a CPU with bf16 units, and float32 under the test
suite's ``PAGED_CPU_BF16=0``): set both as served to measure what users get.
``quantized_gemm.py`` times the projections alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from paged_server.config import EngineConfig
from paged_server.engine.core.llm_engine import LLMEngine
from paged_server.models.quantization import weight_bytes
from paged_server.sampling_params import SamplingParams

FORMATS = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    # Activations as served (``--dtype auto``): bf16 on a CPU with bf16 units, else float32.
    "int8": dict(dtype="auto", quantization="int8"),
    "int4": dict(dtype="auto", quantization="int4"),
}


def decode_rate(
    engine: LLMEngine, concurrency: int, tokens: int, tag: str
) -> tuple[float, float]:
    """Decode tokens per second for ``concurrency`` greedy streams: per
    wall-clock second, and per second of this process's CPU time (on a
    shared, oversubscribed machine the second is the steadier measure; with
    ``--threads 1`` it is the work a step costs)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"{tag}-{i}", [1 + i, 50, 60, 70, 80, 90, 100, 110], params)
    engine.step()  # prefill + first token
    start, cpu, steps = time.perf_counter(), time.process_time(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    done = concurrency * steps
    return done / (time.perf_counter() - start), done / (time.process_time() - cpu)


def forward_mode(engine: LLMEngine) -> str:
    """``compiled`` when the engine runs the torch.compile'd forward pass, else ``eager``."""
    return "compiled" if engine.worker.compiled is not None else "eager"


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``), and whether it has AMX / AVX512-BF16."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    extras = [f for f in ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni") if f in flags.split()]
    return f"{name} ({', '.join(extras) or 'no AMX/AVX512-BF16'})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the ~100M bench Llama)")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, of " + ",".join(FORMATS))
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--tokens", type=int, default=32, help="decode tokens per stream per run")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps({"threads": torch.get_num_threads(), "cpu": cpu_name()}), flush=True)
    if args.model is None:
        from paged_server.bench.model_configs import ensure_llama_100m

        args.model = str(ensure_llama_100m())
    levels = [int(c) for c in args.concurrency.split(",")]
    engines: dict[str, LLMEngine] = {}
    for name in args.formats.split(","):
        config = EngineConfig(model=args.model, device="cpu", max_model_len=256,
                              max_batch_size=max(levels), **FORMATS[name])  # type: ignore[arg-type]  # fmt: skip
        engines[name] = LLMEngine(config)
    walls: dict[tuple[str, int], list[float]] = {}
    cpus: dict[tuple[str, int], list[float]] = {}
    run = 0
    for _ in range(args.rounds):
        for c in levels:
            for name, engine in engines.items():
                run += 1
                wall, cpu = decode_rate(engine, c, args.tokens, f"r{run}")
                walls.setdefault((name, c), []).append(wall)
                cpus.setdefault((name, c), []).append(cpu)
    rows: list[dict[str, Any]] = []
    for c in levels:
        wall = {n: statistics.median(walls[(n, c)]) for n in engines}
        cpu = {n: statistics.median(cpus[(n, c)]) for n in engines}
        for name, engine in engines.items():
            row: dict[str, Any] = {"format": name, "concurrency": c, "activations": str(engine.loaded.dtype)[6:],
                                   "forward": forward_mode(engine)}  # fmt: skip
            for label, rate in (("wall", wall), ("cpu", cpu)):
                row[f"{label}_tok_s"] = round(rate[name], 2)
                for ref in ("float32", "bfloat16"):
                    row[f"{label}_vs_{ref}"] = round(rate[name] / rate[ref], 2) if ref in rate else None
            row["wall_runs"] = [round(r, 2) for r in walls[(name, c)]]
            row["weight_bytes"] = weight_bytes(engine.loaded.model)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'format':10} {'forward':8} {'act':8} {'conc':>4} {'wall tok/s':>10} {'vs fp32':>8} {'vs bf16':>8} "
          f"{'cpu tok/s':>10} {'vs fp32':>8} {'vs bf16':>8} {'weights MB':>10}")  # fmt: skip
    for r in rows:
        print(f"{r['format']:10} {r['forward']:8} {r['activations']:8} {r['concurrency']:>4} {r['wall_tok_s']:>10} {r['wall_vs_float32']!s:>8} "
              f"{r['wall_vs_bfloat16']!s:>8} {r['cpu_tok_s']:>10} {r['cpu_vs_float32']!s:>8} "
              f"{r['cpu_vs_bfloat16']!s:>8} {r['weight_bytes'] / 1e6:>10.1f}")  # fmt: skip
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
