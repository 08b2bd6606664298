"""Multi-turn chat with and without the KV cache tiers, side by side.

    python benchmarks/kv_tiers.py [--conversations 64 --turns 6 --turn-tokens 200]

Each conversation's turn adds ``--turn-tokens`` new prompt tokens to its
history (the earlier turns and answers); turns go round the conversations,
one request at a time, so a request's time to first token is its own
prefill. The pool holds about a quarter of the conversations' final
histories, so without tiers a returning turn finds its history evicted.
Both runs use the embedded default model, greedy, on the same prompts:
prompt tokens served from cache, TTFT p50 of returning turns (turn >= 2),
generated tokens/s. Then a warm start: a new engine on the same
``--kv-disk-dir`` is sent each conversation's last prompt, and the share of
it restored from disk is reported. Writes benchmarks/results/kv_tiers.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from paged_server.entrypoints.llm import LLM
from paged_server.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "kv_tiers.json"
ANSWER = 16  # tokens generated per turn


def run_turn(engine: Any, rid: str, prompt: list[int]) -> tuple[list[int], float, int]:
    """One request alone: (its tokens, seconds to the first token, cached prompt tokens)."""
    params = SamplingParams(max_tokens=ANSWER, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(rid, prompt, params)
    tokens: list[int] = []
    ttft, cached = None, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != rid:
                continue
            tokens += out.new_token_ids
            cached = max(cached, out.num_cached_tokens)
            if ttft is None and tokens:
                ttft = time.perf_counter() - start
    return tokens, ttft or 0.0, cached


def workload(args: argparse.Namespace, llm: LLM, label: str) -> dict[str, Any]:
    """Every turn of every conversation; the histories it ends with."""
    engine, rng = llm.engine, random.Random(0)
    vocab = engine.model_config.vocab_size
    history: list[list[int]] = [[] for _ in range(args.conversations)]
    prompt_tokens = cached_tokens = generated = 0
    returning_ttft: list[float] = []
    start = time.perf_counter()
    for turn in range(args.turns):
        for c in range(args.conversations):
            prompt = history[c] + [rng.randrange(3, vocab) for _ in range(args.turn_tokens)]
            tokens, ttft, cached = run_turn(engine, f"{label}-{c}-{turn}", prompt)
            prompt_tokens += len(prompt)
            cached_tokens += cached
            generated += len(tokens)
            if turn:
                returning_ttft.append(ttft)
            history[c] = prompt + tokens
    seconds = time.perf_counter() - start
    return {
        "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
        "cached_share": cached_tokens / prompt_tokens,
        "ttft_p50_returning_s": statistics.median(returning_ttft),
        "generated_tokens": generated, "seconds": seconds,
        "tokens_per_s": (prompt_tokens + generated) / seconds,
        "histories": history,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--turn-tokens", type=int, default=200)
    parser.add_argument("--host-gib", type=float, default=4.0)
    args = parser.parse_args()
    final = args.turns * (args.turn_tokens + ANSWER)
    blocks = max(64, args.conversations * -(-final // 16) // 4)  # a quarter of the histories
    base = dict(block_size=16, num_gpu_blocks=blocks, max_model_len=final + 64, max_batch_size=8)
    with tempfile.TemporaryDirectory() as disk:
        plain = workload(args, LLM(**base), "plain")
        tiered_llm = LLM(kv_offloading_size=args.host_gib, kv_disk_dir=disk, **base)
        tiered = workload(args, tiered_llm, "tiers")
        metrics = tiered_llm.engine.metrics()
        tiered_llm.shutdown()
        same = plain.pop("histories") == (histories := tiered.pop("histories"))
        warm_llm = LLM(kv_offloading_size=args.host_gib, kv_disk_dir=disk, **base)
        warm_prompt = warm_cached = 0
        for c, hist in enumerate(histories):
            prompt = hist[: -ANSWER]  # the last turn's prompt, as sent
            _, _, cached = run_turn(warm_llm.engine, f"warm-{c}", prompt)
            warm_prompt, warm_cached = warm_prompt + len(prompt), warm_cached + cached
        warm_disk = warm_llm.engine.metrics().get("kv_offload_hits_disk_tokens_total", 0.0)
    result = {
        "workload": {"conversations": args.conversations, "turns": args.turns,
                     "turn_tokens": args.turn_tokens, "answer_tokens": ANSWER,
                     "pool_blocks": blocks, "block_size": 16, "host_gib": args.host_gib},
        "without_tiers": plain, "with_tiers": tiered, "same_tokens": same,
        "ttft_speedup": plain["ttft_p50_returning_s"] / tiered["ttft_p50_returning_s"],
        "tokens_per_s_ratio": tiered["tokens_per_s"] / plain["tokens_per_s"],
        "warm_start": {"prompt_tokens": warm_prompt, "cached_tokens": warm_cached,
                       "from_disk_tokens": warm_disk, "share_from_disk": warm_disk / warm_prompt},
        "tier_metrics": {k: v for k, v in metrics.items() if k.startswith("kv_offload_")},
    }  # fmt: skip
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    rows = [("prompt tokens from cache", "cached_share", "{:.1%}"),
            ("TTFT p50, returning turns (ms)", "ttft_p50_returning_s", None),
            ("tokens/s (prompt + generated)", "tokens_per_s", "{:.0f}"),
            ("wall time (s)", "seconds", "{:.1f}")]  # fmt: skip
    print(f"{'':34} {'pool only':>12} {'with tiers':>12}")
    for name, key, fmt in rows:
        a, b = plain[key], tiered[key]
        if fmt is None:
            a, b, fmt = a * 1e3, b * 1e3, "{:.1f}"
        print(f"{name:34} {fmt.format(a):>12} {fmt.format(b):>12}")
    print(f"TTFT speedup {result['ttft_speedup']:.1f}x, tokens/s ratio {result['tokens_per_s_ratio']:.2f}; "
          f"warm start: {result['warm_start']['share_from_disk']:.1%} of prompt tokens from disk; "
          f"same tokens: {same}")


if __name__ == "__main__":
    main()
