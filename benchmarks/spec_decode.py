"""Speculative decoding on a CPU: prompt lookup and a draft model against no speculation, side by side in one run.

The workload is the one speculation is meant for: prompts whose answers
repeat their context. Each prompt holds a passage of Python's own help text
(``pydoc_data.topics``) and then asks for it again, giving its first
words; a model that has learnt to copy continues with the rest. On the
trained default model (``--model trained-default``, trained once, ~15 min),
greedy, 96 new tokens each.

Three engines are built in this process (same model, compiled forward, the
CPU default): no speculation, prompt lookup (``ngram``) and a draft model
(``draft_model``: by default the trained default model's first
``--draft-layers`` layers with its final norm and tied head, a
layer-truncated copy written once to ~/.cache/paged; ``--draft DIR`` for
another). They run alternately, ``--repeats`` times:
- one stream: the prompts one after another; tokens/s, and from each
  speculating engine's counters the acceptance rate alpha (drafts kept / drafts
  checked), tokens per target step, and the cost of its decode step against a
  plain decode step (mean step time of each engine, prompt steps left out;
  a draft model's drafting is inside its step). The bound speculation can
  reach is E[tokens per step] / cost, E = (1 - alpha^(k+1)) / (1 - alpha).
- ``--streams`` streams (32): the same prompts repeated, all at once; tokens/s.

Writes benchmarks/results/spec_decode.json and re-renders docs/benchmarks.md.

    python benchmarks/spec_decode.py [--model trained-default] [--k 4] [--draft-layers 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from paged_server.bench.environment import describe_environment
from paged_server.config import EngineConfig
from paged_server.default_model.trained import TRAINED_MODEL_ALIAS, ensure_trained_model
from paged_server.engine.core.llm_engine import LLMEngine
from paged_server.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def passages(tokenizer: Any, count: int, length: int = 120, seed_words: int = 12) -> list[list[int]]:
    """``count`` prompts: a passage of ``length`` tokens of Python's help text,
    a blank line, then its first ``seed_words`` tokens again."""
    from pydoc_data.topics import topics

    texts = [t for _, t in sorted(topics.items()) if len(t) > 4000]
    prompts = []
    for text in texts:
        ids = tokenizer.encode(text[1000:6000], add_special_tokens=False)[:length]
        if len(ids) < length:
            continue
        again = tokenizer.encode("\n\n", add_special_tokens=False)
        prompts.append(ids + again + ids[:seed_words])
        if len(prompts) == count:
            break
    return prompts


def truncated_copy(model: str, layers: int) -> Path:
    """A draft: ``model``'s first ``layers`` decoder layers, its embeddings,
    final norm and head (weights copied, nothing trained), written once
    beside the model's cache folder."""
    from safetensors.torch import load_file, save_file

    src = ensure_trained_model() if model == TRAINED_MODEL_ALIAS else Path(model)
    dst = src.parent / f"{src.name}-first{layers}"
    if (dst / "model.safetensors").is_file():
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("*.safetensors", "training.json"))
    config = json.loads((src / "config.json").read_text())
    if not 1 <= layers < config["num_hidden_layers"]:
        raise SystemExit(f"--draft-layers: must be 1..{config['num_hidden_layers'] - 1}, got {layers}")
    config["num_hidden_layers"] = layers
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = load_file(src / "model.safetensors")
    keep = {k: v for k, v in weights.items() if not k.startswith("model.layers.")
            or int(k.split(".")[2]) < layers}  # fmt: skip
    save_file(keep, tmp / "model.safetensors", metadata={"format": "pt"})
    tmp.rename(dst)
    return dst


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, together: bool) -> dict[str, Any]:
    """Generate for ``prompts`` (all at once, or one after another); tokens/s
    and the engine's step and draft counters over the run."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = engine.metrics()
    steps, step_time, generated = 0, 0.0, 0
    start = time.perf_counter()
    groups = [prompts] if together else [[p] for p in prompts]
    for g, group in enumerate(groups):
        for i, prompt in enumerate(group):
            engine.add_request(f"r{g}-{i}-{time.monotonic_ns()}", prompt, params)
        first = True  # a group's first step is its prompt's: not a decode step
        while engine.has_unfinished():
            t = time.perf_counter()
            made = sum(len(out.new_token_ids) for out in engine.step())
            if not first:
                step_time += time.perf_counter() - t
                steps += 1
                generated += made
            first = False
    wall = time.perf_counter() - start
    after = engine.metrics()

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    drafts, kept = delta("spec_decode_num_draft_tokens_total"), delta("spec_decode_num_accepted_tokens_total")
    return {
        "tokens_per_s": len(prompts) * max_tokens / wall,
        "generated": generated,  # by the decode steps (after each group's first)
        "steps": steps,  # decode steps
        "step_ms": 1e3 * step_time / steps,
        "draft_tokens": drafts,
        "accepted_tokens": kept,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="trained-default", help="a model directory, trained-default, or embedded")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup", default="2,4", help="prompt_lookup_min,prompt_lookup_max")
    p.add_argument("--draft", default=None, help="the draft model's directory (default: a truncated copy)")
    p.add_argument("--draft-layers", type=int, default=1, help="layers of the truncated copy")
    p.add_argument("--methods", default="ngram,draft_model", help="speculating engines to compare")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--no-page", action="store_true")
    args = p.parse_args(argv)
    low, high = (int(x) for x in args.lookup.split(","))
    methods = args.methods.split(",")
    specs: dict[str, dict[str, Any]] = {}
    if "ngram" in methods:
        specs["ngram"] = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": low,
                          "prompt_lookup_max": high}  # fmt: skip
    draft_label = None
    if "draft_model" in methods:
        draft = args.draft or str(truncated_copy(args.model, args.draft_layers))
        draft_label = args.draft or f"{args.model}'s first {args.draft_layers} layer(s), final norm and head"
        specs["draft_model"] = {"model": draft, "num_speculative_tokens": args.k}
    base = dict(model=None if args.model == "embedded" else args.model, max_model_len=1024, max_batch_size=args.streams, device="cpu")
    load_before = os.getloadavg()[0]  # the machine may be shared: the page says how busy it was
    engines = {"off": LLMEngine(EngineConfig(**base))}
    engines.update({name: LLMEngine(EngineConfig(**base, speculative_config=spec)) for name, spec in specs.items()})
    prompts = passages(engines["off"].tokenizer, args.prompts)
    crowd = (prompts * (-(-args.streams // len(prompts))))[: args.streams]
    for engine in engines.values():  # warm: every step shape the runs below compile
        run(engine, prompts[:2], args.max_tokens, together=False)
        run(engine, crowd, args.max_tokens // 4, together=True)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {n: {"one": [], "many": []} for n in engines}
    for r in range(args.repeats):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            for kind, together, group in (("one", False, prompts), ("many", True, crowd)):
                result = run(engines[name], group, args.max_tokens, together)
                runs[name][kind].append(result)
                print(json.dumps({"repeat": r, "config": name, "streams": 1 if kind == "one" else len(group),
                                  **{k: round(v, 3) for k, v in result.items()}}), flush=True)  # fmt: skip

    def med(name: str, kind: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[name][kind])

    k = args.k
    one: dict[str, Any] = {"off_tokens_per_s": round(med("off", "one", "tokens_per_s"), 2)}
    many: dict[str, Any] = {"off_tokens_per_s": round(med("off", "many", "tokens_per_s"), 2)}
    for name in specs:
        alpha = sum(x["accepted_tokens"] for x in runs[name]["one"]) / max(
            1.0, sum(x["draft_tokens"] for x in runs[name]["one"])
        )
        expected = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1.0
        cost = med(name, "one", "step_ms") / med("off", "one", "step_ms")
        speedup = med(name, "one", "tokens_per_s") / med("off", "one", "tokens_per_s")
        one[name] = {
            "tokens_per_s": round(med(name, "one", "tokens_per_s"), 2),
            "speedup": round(speedup, 3),
            "acceptance_rate": round(alpha, 3),
            "tokens_per_target_step": round(med(name, "one", "generated") / med(name, "one", "steps"), 3),
            "step_cost": round(cost, 3),
            "bound": round(expected / cost, 3),
            "efficiency": round(speedup / (expected / cost), 3),
        }
        many_alpha = sum(x["accepted_tokens"] for x in runs[name]["many"]) / max(
            1.0, sum(x["draft_tokens"] for x in runs[name]["many"])
        )
        many[name] = {
            "tokens_per_s": round(med(name, "many", "tokens_per_s"), 2),
            "ratio": round(med(name, "many", "tokens_per_s") / med("off", "many", "tokens_per_s"), 3),
            "acceptance_rate": round(many_alpha, 3),
            "tokens_per_target_step": round(med(name, "many", "generated") / med(name, "many", "steps") / len(crowd), 3),
        }
    result = {
        "benchmark": "spec_decode",
        "command": " ".join([*(f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}" for _ in [0]
                               if "OMP_NUM_THREADS" in os.environ),
                             "python benchmarks/spec_decode.py", *(sys.argv[1:] if argv is None else argv)]),
        "model": args.model,
        "speculative_configs": specs,
        "draft": draft_label,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "streams": args.streams,
        "one_stream": one,
        f"streams_{args.streams}": many,
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # 1-min, before and after
        "runs": runs,
        "environment": describe_environment(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spec_decode.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "environment")}), flush=True)
    if not args.no_page:
        from report import write_page

        write_page(args.out, ROOT / "docs")
    for engine in engines.values():
        engine.shutdown()
    return result


if __name__ == "__main__":
    main()
