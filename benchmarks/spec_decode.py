"""Speculative decoding on a CPU: prompt lookup and a draft model against no speculation, side by side in one run.

The workload is the one speculation is meant for: prompts whose answers
repeat their context. Each prompt holds a passage of Python's own help text
(``pydoc_data.topics``, ``--passage`` tokens) and then asks for it again,
giving its first ``--seed-words`` tokens; the answer is the rest of the
passage (``--max-tokens``: 48 by default, greedy). Prompt and answer fit
the 128 tokens the model was trained on. On the trained default model
(``--model trained-default``, trained once, ~15 min). That model has not
learnt to copy (docs/kv-cache.md), so what prompt lookup finds is its own
repeated phrases: the acceptance measured here is the model's, and the
bound column says what the engine made of it. ``--model copying`` runs
the same on a pair that has: the recipe after an induction warm start
(``COPYING``) on the whole model, the target (trained once, ~35 min), and
on two layers, its draft (~25 min).

Three engines are built in this process (same model, compiled forward, the
CPU default): no speculation, prompt lookup (``ngram``) and a draft model
(``draft_model``: by default the model's recipe on two layers,
``ensure_trained_model(layers=DRAFT_LAYERS)``, trained once; ``--draft
DIR`` for another). They run alternately, ``--repeats``
times:
- one stream: the prompts one after another; tokens/s, and from each
  speculating engine's counters the acceptance rate alpha (drafts kept / drafts
  checked), tokens per target step, and the cost of a verify step (a step
  that checked drafts, drafting included) against the plain engine's decode
  step. The bound speculation can reach is max(1, E / cost), E = (1 -
  alpha^(k+1)) / (1 - alpha): drafting every step where that pays, and not
  drafting where it does not.
- ``--streams`` streams (32): the same prompts repeated, all at once; tokens/s.

Writes benchmarks/results/spec_decode.json and re-renders docs/benchmarks.md.

    python benchmarks/spec_decode.py [--model trained-default|copying|DIR] [--k 4] [--draft DIR] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from paged_server.bench.environment import describe_environment
from paged_server.config import EngineConfig
from paged_server.default_model.trained import (
    DRAFT_LAYERS,
    TRAINED_MODEL_ALIAS,
    ensure_trained_model,
)
from paged_server.engine.core.llm_engine import LLMEngine
from paged_server.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def passages(tokenizer: Any, count: int, length: int, seed_words: int) -> list[list[int]]:
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


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, together: bool) -> dict[str, Any]:
    """Generate for ``prompts`` (all at once, or one after another); tokens/s
    and the engine's step and draft counters over the run."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = engine.metrics()
    counters = engine.counters
    steps, step_time, generated = 0, 0.0, 0
    verify_steps, verify_time = 0, 0.0  # steps that checked drafts
    start = time.perf_counter()
    groups = [prompts] if together else [[p] for p in prompts]
    for g, group in enumerate(groups):
        for i, prompt in enumerate(group):
            engine.add_request(f"r{g}-{i}-{time.monotonic_ns()}", prompt, params)
        first = True  # a group's first step is its prompt's: not a decode step
        while engine.has_unfinished():
            drafts = counters.spec_drafts
            t = time.perf_counter()
            made = sum(len(out.new_token_ids) for out in engine.step())
            if not first:
                took = time.perf_counter() - t
                step_time += took
                steps += 1
                generated += made
                if counters.spec_drafts > drafts:
                    verify_steps += 1
                    verify_time += took
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
        "verify_steps": verify_steps,
        "verify_step_ms": 1e3 * verify_time / verify_steps if verify_steps else None,
        "draft_tokens": drafts,
        "accepted_tokens": kept,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="trained-default", help="a model directory, trained-default, copying, or embedded")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup", default="2,4", help="prompt_lookup_min,prompt_lookup_max")
    p.add_argument("--draft", default=None,
                   help="the draft model's directory (default, for trained-default and copying: its "
                   f"recipe on {DRAFT_LAYERS} layers)")  # fmt: skip
    p.add_argument("--methods", default="ngram,draft_model", help="speculating engines to compare")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--passage", type=int, default=56, help="tokens of each passage")
    p.add_argument("--seed-words", type=int, default=8, help="tokens of the passage asked for again")
    p.add_argument("--max-tokens", type=int, default=48)
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
    trained = args.model in (TRAINED_MODEL_ALIAS, "copying")  # a recipe of ours: its draft is ours too
    if "draft_model" in methods:
        if args.draft is None and not trained:
            raise SystemExit("--draft DIR: the draft model for --model " + args.model)
        copying = args.model == "copying"
        draft = args.draft or str(ensure_trained_model(layers=DRAFT_LAYERS, copying=copying))
        draft_label = args.draft or (
            f"the copying recipe on {DRAFT_LAYERS} layers ({Path(draft).name})" if copying
            else f"{args.model}'s recipe on its first {DRAFT_LAYERS} layers, trained"
        )
        specs["draft_model"] = {"model": draft, "num_speculative_tokens": args.k}
    label = args.model
    if args.model == "copying":  # taught to copy (ensure_trained_model(copying=True))
        args.model = str(ensure_trained_model(copying=True))
        label = f"The copying model ({Path(args.model).name}: the recipe after an induction warm start)"
    base = dict(model=None if args.model == "embedded" else args.model, max_model_len=1024, max_batch_size=args.streams, device="cpu")
    load_before = os.getloadavg()[0]  # the machine may be shared: the page says how busy it was
    engines = {"off": LLMEngine(EngineConfig(**base))}
    engines.update({name: LLMEngine(EngineConfig(**base, speculative_config=spec)) for name, spec in specs.items()})
    prompts = passages(engines["off"].tokenizer, args.prompts, args.passage, args.seed_words)
    crowd = (prompts * (-(-args.streams // len(prompts))))[: args.streams]
    for engine in engines.values():  # warm: every step shape the runs below compile, and what
        run(engine, prompts[:2], args.max_tokens, together=False)  # the engine learns from its
        run(engine, crowd, args.max_tokens, together=True)  # steps (acceptance, step times)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {n: {"one": [], "many": []} for n in engines}
    for r in range(args.repeats):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            for kind, together, group in (("one", False, prompts), ("many", True, crowd)):
                result = run(engines[name], group, args.max_tokens, together)
                runs[name][kind].append(result)
                print(json.dumps({"repeat": r, "config": name, "streams": 1 if kind == "one" else len(group),
                                  **{k: v if v is None else round(v, 3) for k, v in result.items()}}), flush=True)  # fmt: skip

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
        # a verify step's time (drafting included) over a plain engine's decode step
        verify_ms = [x["verify_step_ms"] for x in runs[name]["one"] if x["verify_step_ms"]]
        cost = statistics.median(verify_ms) / med("off", "one", "step_ms") if verify_ms else None
        speedup = med(name, "one", "tokens_per_s") / med("off", "one", "tokens_per_s")
        # speculating where it pays, or not at all where it does not: at best max(1, E / cost)
        bound = max(1.0, expected / cost) if cost else None
        one[name] = {
            "tokens_per_s": round(med(name, "one", "tokens_per_s"), 2),
            "speedup": round(speedup, 3),
            "acceptance_rate": round(alpha, 3),
            "tokens_per_target_step": round(med(name, "one", "generated") / med(name, "one", "steps"), 3),
            "verify_step_share": round(med(name, "one", "verify_steps") / med(name, "one", "steps"), 3),
            "step_cost": round(cost, 3) if cost else None,
            "bound": round(bound, 3) if bound else None,
            "efficiency": round(speedup / bound, 3) if bound else None,
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
        "model": label,
        "speculative_configs": specs,
        "draft": draft_label,
        "prompts": len(prompts),
        "passage_tokens": args.passage,
        "seed_words": args.seed_words,
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
