"""Speculative decoding against llama.cpp's: paged-server and llama-server, each with and without speculation, one stream.

The same requests as ``spec_decode.py`` (prompts that ask for a passage
again; the answer is the rest of it), greedy, one at a time over HTTP
(``/v1/completions``, token-id prompts, streamed), on the trained default
model and its draft (the same recipe on two layers), or with ``--model
copying`` on the pair taught to copy, converted to GGUF by llama.cpp's own
converter. Three methods on each server:
- ``off``: no speculation;
- ``ngram``: paged ``{"method": "ngram", "num_speculative_tokens": K,
  "prompt_lookup_min": N, "prompt_lookup_max": N_MAX}``; llama.cpp
  ``--spec-type ngram-simple --spec-ngram-simple-size-n N
  --spec-ngram-simple-size-m K``;
- ``draft_model``: paged ``{"model": DRAFT, "num_speculative_tokens": K}``;
  llama.cpp ``-md DRAFT.gguf --spec-draft-n-max K``.
Each (server, method) is started fresh, warmed with one request, and runs
the request set; the order rotates every repeat; medians. Needs a built
llama-server (``python benchmarks/llamacpp_peer.py --build --build-only``);
without one it says so and exits 0. Writes
benchmarks/results/spec_decode_peer.json and re-renders docs/benchmarks.md.

    python benchmarks/spec_decode_peer.py [--outtype f16] [--k 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("trained-default", "copying"), default="trained-default",
                   help="the target and its 2-layer draft: the trained default recipe, or the "
                   "pair taught to copy (spec_decode.py --model copying)")  # fmt: skip
    p.add_argument("--outtype", default="f16", help="llama.cpp's GGUF type for both models")
    p.add_argument("--k", type=int, default=4, help="draft tokens per step")
    p.add_argument("--lookup", default="2,4", help="prompt_lookup_min,prompt_lookup_max (llama.cpp: size-n = min)")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--passage", type=int, default=56)
    p.add_argument("--seed-words", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2, help="times the prompts are sent per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="llama-server -t / -tb")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--logs", type=Path, help="keep every server's log in this folder")
    p.add_argument("--no-page", action="store_true")
    args = p.parse_args(argv)

    from paged_server.bench.environment import describe_environment
    from paged_server.bench.serving import completion_body
    from paged_server.bench.workloads import RequestSpec
    from paged_server.default_model.trained import DRAFT_LAYERS, ensure_trained_model
    from paged_server.tokenizer import Tokenizer
    from peers import llamacpp as lc
    from peers.serving import headline, measure_run, medians, rotation
    from spec_decode import passages

    tree = lc.find_llamacpp()
    if tree is None:
        print(lc.missing_message(), file=sys.stderr)
        return 0
    copying = args.model == "copying"
    model = ensure_trained_model(copying=copying)
    draft = ensure_trained_model(layers=DRAFT_LAYERS, copying=copying)
    gguf, draft_gguf = (lc.convert_to_gguf(tree, d, args.outtype) for d in (model, draft))
    low, high = (int(x) for x in args.lookup.split(","))
    k = args.k
    paged_specs: dict[str, dict[str, Any] | None] = {
        "off": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low,
                  "prompt_lookup_max": high},
        "draft_model": {"model": str(draft), "num_speculative_tokens": k},
    }  # fmt: skip
    llama_flags: dict[str, tuple[str, ...]] = {
        "off": (),
        "ngram": ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(low),
                  "--spec-ngram-simple-size-m", str(k)),
        "draft_model": ("-md", str(draft_gguf), "--spec-draft-n-max", str(k)),
    }  # fmt: skip
    prompts = passages(Tokenizer.from_dir(model), args.prompts, args.passage, args.seed_words)
    bodies = [completion_body(RequestSpec(f"p{i}", tuple(ids), args.max_tokens))
              for i, ids in enumerate(prompts)] * args.rounds  # fmt: skip
    ctx = args.passage + args.seed_words + args.max_tokens + 16

    def starter(server: str, method: str) -> Any:
        def start(port: int, concurrency: int, log: Path | None) -> Any:
            if server == "llama.cpp":
                return lc.start_llama_server(tree, gguf, port, parallel=1, ctx_per_seq=max(ctx, 256),
                                             threads=args.threads, log=log, extra=llama_flags[method])  # fmt: skip
            spec = paged_specs[method]
            extra = ("--speculative-config", json.dumps(spec)) if spec else ()
            return lc.start_paged_server(model, port, extra, log)

        return start

    peers = [(server, method) for method in paged_specs for server in ("paged", "llama.cpp")]
    names = [f"{server} {method}" for server, method in peers]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    load_before = os.getloadavg()[0]
    env = describe_environment()
    for repeat in range(args.repeats):
        for name in rotation(names, repeat):
            server, method = name.split(" ", 1)
            log = args.logs / f"{name.replace(' ', '_')}-{repeat}.log" if args.logs else None
            if args.logs:
                args.logs.mkdir(parents=True, exist_ok=True)
            run = measure_run(starter(server, method), bodies, 1, log)
            runs[name].append(headline(run))
            print(json.dumps({"repeat": repeat, "peer": name, **runs[name][-1]}), flush=True)
    by_peer = {n: medians(r) for n, r in runs.items()}

    def tps(name: str) -> float:
        return float(by_peer[name]["output_tokens_per_s"] or 0.0)

    ratios = {
        method: {
            "paged_vs_off": round(tps(f"paged {method}") / tps("paged off"), 3),
            "llamacpp_vs_off": round(tps(f"llama.cpp {method}") / tps("llama.cpp off"), 3),
            "paged_vs_llamacpp": round(tps(f"paged {method}") / tps(f"llama.cpp {method}"), 3),
        }
        for method in paged_specs
    }
    result = {
        "benchmark": "spec_decode_peer",
        "command": "python benchmarks/spec_decode_peer.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": str(model.name), "draft": str(draft.name), "outtype": args.outtype,
        "prompts": len(prompts), "passage_tokens": args.passage, "seed_words": args.seed_words,
        "max_tokens": args.max_tokens, "rounds": args.rounds, "repeats": args.repeats,
        "paged_speculative_configs": {m: s for m, s in paged_specs.items() if s},
        "llamacpp_flags": {m: " ".join(f).replace(str(Path.home()), "~") for m, f in llama_flags.items() if f},
        "by_peer": by_peer, "ratios": ratios, "runs": runs,
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "environment": env,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spec_decode_peer.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"by_peer": by_peer, "ratios": ratios}), flush=True)
    if not args.no_page:
        from report import write_page

        write_page(args.out, ROOT / "docs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
