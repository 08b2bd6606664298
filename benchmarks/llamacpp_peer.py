"""llama.cpp as a peer: paged-server against llama-server on the same model and requests.

Builds nothing unless asked (``--build``: pip downloads the llama-cpp-python
sdist and compiles its vendored llama.cpp CPU-only under ``nice``, ~15+ min on
2 cores, cached under ~/.cache/paged/llama.cpp/<version>/); without a build
it prints why it skipped and exits 0. Converts the model to GGUF with
llama.cpp's own converter (cached), checks greedy text agrees, runs the
comparison (see ``peers/serving.py``), writes
benchmarks/results/llamacpp_peer.json and re-renders docs/benchmarks.md.

``--quantized`` compares quantized weights instead, pair by pair: paged
``--quantization int8`` against llama.cpp's Q8_0 GGUF and ``int4`` against
Q4_0 (by default on the ~100M model at 1 and 8 streams), into
benchmarks/results/llamacpp_quantized.json.

    python benchmarks/llamacpp_peer.py --build                       # once
    python benchmarks/llamacpp_peer.py --model-config 30m --concurrency 1,8,16,32 --repeats 2
    python benchmarks/llamacpp_peer.py --outtypes q8_0,q4_0 ...      # q4_0 / q4_k_m by llama-quantize
    python benchmarks/llamacpp_peer.py --quantized                   # int8 vs Q8_0, int4 vs Q4_0, 100M, 1 and 8 streams
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_NAME = "llamacpp_peer"
QUANTIZED_RESULTS_NAME = "llamacpp_quantized"
DEFAULT_PAIRS = "int8=q8_0,int4=q4_0"
# Defaults that differ with --quantized: issue 30 asks for the ~100M model at 1 and 8 streams.
DEFAULTS = {False: {"model_config": "30m", "concurrency": "1,8,16,32"},
            True: {"model_config": "100m", "concurrency": "1,8"}}  # fmt: skip


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", action="store_true", help="download and build llama.cpp first (cached)")
    p.add_argument("--targets", default="llama-server,llama-quantize", help="cmake targets for --build")
    p.add_argument("--build-only", action="store_true", help="stop after --build")
    p.add_argument("--model-config", choices=("embedded", "30m", "100m"),
                   help="random Llamas of that size (default 30m; 100m with --quantized)")
    p.add_argument("--quantized", nargs="?", const=DEFAULT_PAIRS, metavar="PAIRS",
                   help=f"paged --quantization METHOD against llama.cpp's GGUF_TYPE, per METHOD=GGUF_TYPE pair "
                        f"(default {DEFAULT_PAIRS}), instead of --outtypes against dense paged")
    p.add_argument("--model", help="a Hugging Face directory instead of --model-config")
    p.add_argument("--outtypes", default="f32,f16", help="GGUF types to serve: f32,f16,bf16,q8_0,q4_0,q4_k_m")
    p.add_argument("--concurrency", help="closed-loop streams per run (default 1,8,16,32; 1,8 with --quantized)")
    p.add_argument("--repeats", type=int, default=2, help="runs per peer and concurrency (median)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per run at concurrency > 1")
    p.add_argument("--single-stream-requests", type=int, default=8, help="requests per run at concurrency 1")
    p.add_argument("--agreement-prompts", type=int, default=5, help="prompts whose greedy text is compared")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t / -tb")
    p.add_argument("--paged-variant", action="append", default=[], metavar="FLAGS",
                   help='another paged-server peer with these extra flags, e.g. "--enforce-eager" (repeatable)')
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="results folder")
    p.add_argument("--logs", type=Path, help="keep every server's log in this folder")
    p.add_argument("--no-page", action="store_true", help="leave docs/benchmarks.md alone (run_all renders it)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with the defaults of the comparison asked for (dense or ``--quantized``)."""
    args = build_parser().parse_args(argv)
    for key, value in DEFAULTS[args.quantized is not None].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from paged_server.bench.environment import describe_environment
    from paged_server.bench.model_configs import count_parameters, resolve_model
    from peers import llamacpp as lc
    from peers.serving import compare, parse_pairs

    pairs = parse_pairs(args.quantized) if args.quantized is not None else []

    if args.build:
        lc.build_llamacpp(targets=tuple(_csv(args.targets)))
        if args.build_only:
            return 0
    if lc.find_llamacpp() is None:
        print(lc.missing_message(), file=sys.stderr)
        return 0
    model_dir, name = resolve_model(args.model, args.model_config)

    def emit(record: dict[str, Any]) -> None:
        print(json.dumps(record, sort_keys=True), flush=True)

    env = describe_environment()
    emit(env)
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    data = compare(
        model_dir,
        outtypes=_csv(args.outtypes),
        concurrencies=[int(c) for c in _csv(args.concurrency)],
        repeats=args.repeats,
        num_requests=args.num_requests,
        single_stream_requests=args.single_stream_requests,
        agreement_prompts=args.agreement_prompts,
        threads=args.threads,
        log_dir=args.logs,
        emit=emit,
        paged_variants=args.paged_variant,
        quantized=pairs,
    )
    config = json.loads(Path(model_dir, "config.json").read_text(encoding="utf-8"))
    data["environment"] = env
    data["model"] = {"name": name, "parameters": count_parameters(model_dir), **{
        k: config.get(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")
    }}  # fmt: skip
    data["command"] = "python benchmarks/llamacpp_peer.py " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{QUANTIZED_RESULTS_NAME if pairs else RESULTS_NAME}.json"
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"[llamacpp_peer] wrote {path}", file=sys.stderr)
    if not args.no_page:  # the page lives beside the results: <root>/benchmarks/results -> <root>/docs
        from report import write_page

        docs = ROOT / "docs" if args.out.resolve() == (ROOT / "benchmarks" / "results").resolve() else args.out.parent / "docs"
        print(f"[llamacpp_peer] wrote {write_page(args.out, docs)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
