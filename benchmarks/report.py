"""Render docs/benchmarks.md (and its PNG plots) from benchmarks/results/*.json.

Reads only what run_all.py and pytest-benchmark wrote, so every number on
the page is one the run printed. Missing result files leave their section
out with a note rather than failing.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from plots import plot_batch_sweep, plot_capacity, plot_kv_timeline, plot_prefix_cache

CONFIG_LABELS = {
    "paged": "ours, paged KV",
    "contiguous": "ours, contiguous KV",
    "hf_generate_batch": "transformers generate_batch (continuous)",
    "hf_static_generate": "transformers generate (static, batches of 8)",
}


def _load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _f(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _g(value: Any) -> str:
    """Short form of a microbenchmark's extra_info value."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _lat(d: dict[str, Any]) -> str:
    return " / ".join(_f(d.get(k), 1) for k in ("p50", "p90", "p99"))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|",
    ]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _model_line(m: dict[str, Any]) -> str:
    return (
        f"{m['name']}: {m['parameters'] / 1e6:.1f}M parameters, {m['num_hidden_layers']} layers, hidden {m['hidden_size']}, "
        f"{m['num_attention_heads']} heads / {m['num_key_value_heads']} KV heads x {m['head_dim']}, vocab {m['vocab_size']}"
    )


def _workload_line(w: dict[str, Any]) -> str:
    p = w["params"]
    scale = ""
    if p.get("prompt_scale", 1.0) != 1.0 or p.get("new_tokens_scale", 1.0) != 1.0:
        scale = f" **Scaled**: prompt lengths x{p['prompt_scale']}, max_tokens x{p['new_tokens_scale']}."
    return (
        f"`{w['name']}` (seed {w['seed']}): {w['description']}. {w['num_requests']} requests, prompts "
        f"{w['prompt_tokens']['min']}-{w['prompt_tokens']['max']} tokens (total {w['prompt_tokens']['total']:,}), "
        f"max_tokens {w['max_tokens']['min']}-{w['max_tokens']['max']} (total {w['max_tokens']['total']:,} output tokens), "
        f"EOS ignored, greedy.{scale}"
    )


def _run_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    by = {r["config"]: r for r in runs}

    def ratio(r: dict[str, Any], other: str) -> str:
        o = by.get(other)
        if o is None or not o["tokens_per_s"] or r["config"] == other:
            return "-"
        return f"{r['tokens_per_s'] / o['tokens_per_s']:.2f}x"

    rows = []
    for r in runs:
        rows.append(
            [
                CONFIG_LABELS.get(r["config"], r["config"]),
                _f(r["tokens_per_s"]),
                _f(r["seconds"], 2),
                _lat(r["ttft_ms"]),
                _lat(r["itl_ms"]),
                _f(r["peak_running"]),
                _pct(r["peak_kv_usage"]),
                _pct(r["peak_kv_pool_usage"]),
                _f(r["preemptions"]),
                _pct(r.get("linear_share")),
                ratio(r, "contiguous"),
                ratio(r, "hf_generate_batch"),
                ratio(r, "hf_static_generate"),
            ]
        )
    return rows


RUN_HEADER = [
    "configuration",
    "tokens/s",
    "seconds",
    "TTFT ms p50/p90/p99",
    "ITL ms p50/p90/p99",
    "peak running",
    "peak KV usage",
    "peak pool allocated",
    "preemptions",
    "time in linear layers",
    "vs contiguous",
    "vs HF generate_batch",
    "vs HF static",
]


def _comparison_section(title: str, data: dict[str, Any] | None, intro: str) -> list[str]:
    out = [f"## {title}", ""]
    if data is None:
        return out + ["_Not run yet: `python benchmarks/run_all.py` writes it._", ""]
    b = data["kv_budget"]
    out += [
        intro,
        "",
        f"- Model: {_model_line(data['model'])}.",
        f"- Workload: {_workload_line(data['workload'])}",
        f"- KV budget: {b['rows']} x {b['max_model_len']} = {b['tokens']:,} token slots for every configuration "
        f"(paged: {b['tokens'] // b['block_size']:,} blocks of {b['block_size']}; contiguous: {b['rows']} rows of "
        f"{b['max_model_len']}; transformers' continuous batching: {b['tokens'] // b['block_size']:,} pages of {b['block_size']}).",
        f"- Measured {data['environment']['date']} on {data['environment']['hardware']}.",
        "",
    ]
    out += _table(RUN_HEADER, _run_rows(data["runs"]))
    out.append("")
    return out


def _tensor_parallel_section(data: dict[str, Any] | None) -> list[str]:
    out = _comparison_section(
        "Tensor parallelism: TP=2 vs TP=1 (CPU, gloo)",
        data,
        "The paged engine with `--tensor-parallel-size 1` and `2` on the same workload. On this "
        "CPU machine both ranks share the same cores (each rank gets half the torch threads) "
        "and every layer adds two gloo all-reduces through the loopback network, so TP=2 is "
        "not expected to be faster here: it shows the cost of the communication, not a "
        "speed-up. On a multi-GPU machine each rank has its own GPU and memory bandwidth and "
        "NCCL all-reduces over NVLink; the number to measure there is decode tokens/s and ITL "
        "at equal batch, and the KV capacity at equal per-GPU memory (TP=2 holds twice the "
        "tokens per GPU when the KV heads split).",
    )
    if data is not None:
        ratio = data.get("ratios", {}).get("tp2_vs_tp1")
        comm = data.get("communication", {})
        out += [
            f"TP=2 / TP=1 tokens/s: {_f(ratio, 2)}x. Per forward pass: "
            f"{_g(comm.get('all_reduces_per_step'))} all-reduces (2 per layer) and "
            f"{_g(comm.get('broadcasts_per_message'))} broadcast(s) of the step message.",
            "",
        ]
    return out


def _kv_tiers_section(data: dict[str, Any] | None) -> list[str]:
    """``benchmarks/kv_tiers.py``: multi-turn chat with and without the KV cache tiers."""
    out = ["## KV cache tiers: multi-turn chat (`benchmarks/kv_tiers.py`)", ""]
    if data is None:
        return out + ["_No results (benchmarks/results/kv_tiers.json) yet._", ""]
    w, a, b = data["workload"], data["without_tiers"], data["with_tiers"]
    out += [
        f"{w['conversations']} conversations x {w['turns']} turns, {w['turn_tokens']} new prompt tokens "
        f"and {w['answer_tokens']} generated per turn, one request at a time, a pool of "
        f"{w['pool_blocks']} blocks of {w['block_size']} (about a quarter of the final histories); "
        f"host tier {w['host_gib']} GiB plus a disk tier. Same greedy tokens: {data.get('same_tokens')}.",
        "",
    ]
    out += _table(["", "pool only", "with tiers"], [
        ["prompt tokens from cache", _pct(a["cached_share"]), _pct(b["cached_share"])],
        ["TTFT p50, returning turns (ms)", _f(a["ttft_p50_returning_s"] * 1e3), _f(b["ttft_p50_returning_s"] * 1e3)],
        ["tokens/s (prompt + generated)", _f(a["tokens_per_s"]), _f(b["tokens_per_s"])],
    ])  # fmt: skip
    warm = data["warm_start"]
    return out + [
        f"TTFT {_f(data['ttft_speedup'])}x lower, tokens/s ratio {_f(data['tokens_per_s_ratio'], 2)}. "
        f"Warm start (a new engine on the same --kv-disk-dir): {_pct(warm['share_from_disk'])} of the "
        "last prompts' tokens restored from disk.",
        "",
    ]


def _capacity_section(cap: dict[str, Any] | None, images: Path, docs: Path) -> list[str]:
    out = ["## Capacity: concurrent sequences at equal KV memory", ""]
    if cap is None:
        return out + ["_Not run yet._", ""]
    s = cap["settings"]
    img = plot_capacity(cap, images / "capacity.png")
    out += [
        f"Measured by admitting sequences into the real pools (`paged_ref.ContiguousKVPool` with {s['num_rows']} rows x "
        f"{s['max_model_len']} tokens, `paged_ref.PagedKVPool` with {s['num_blocks']:,} blocks x {s['block_size']} "
        f"tokens: the same {s['token_slots']:,} token slots and the same bytes) until one refuses. Lengths are drawn "
        f"uniformly within +/-{int(100 * s['length_spread'])}% of the average (narrower near max_model_len so the mean holds), "
        f"seed {s['seed']}.",
        "",
        f"![capacity]({img.relative_to(docs).as_posix()})",
        "",
    ]
    rows = [
        [
            _f(r["avg_len_target"]),
            _f(r["paged_mean_len"]),
            _f(r["contiguous"]),
            _f(r["paged"]),
            f"{r['ratio']:.2f}x",
            _pct(r["paged_tokens_held"] / s["token_slots"]),
        ]
        for r in cap["rows"]
    ]
    out += _table(
        [
            "avg length (target)",
            "avg length (admitted)",
            "contiguous",
            "paged",
            "paged / contiguous",
            "token slots filled (paged)",
        ],
        rows,
    )
    return out + [""]


def _kv_label(row: dict[str, Any]) -> str:
    """`int8`, or `int8` + calculate_kv_scales (rows from before that flag have no key)."""
    return f"`{row['kv_cache_dtype']}`" + (
        " + calculate_kv_scales" if row.get("calculate_kv_scales") else ""
    )


def _kv_accuracy_trained_section(data: dict[str, Any] | None) -> list[str]:
    """The KV dtypes on the trained evaluation model (opt-in run_all step)."""
    if data is None:
        return []
    t, st = data["training"], data["settings"]
    out = ["## KV cache dtypes on the trained evaluation model", ""]
    out.append(
        f"{data['model']}: trained {t['recipe']['steps']} steps on {t['train_tokens']:,} tokens "
        f"({t['seconds']:.0f} s), held-out loss {t['heldout_loss']:.2f} nats (train "
        f"{t['last_train_loss']:.2f}). Perplexity of {st['text_tokens']:,} held-out tokens in "
        f"{st['window']}-token windows through a pool of each dtype; greedy agreement = share of "
        f"{st['num_prompts']} prompts x {st['max_tokens']} greedy tokens before the first that "
        "differs from `auto`'s. Measured " + data["environment"]["date"] + "."
    )
    out.append("")
    rows = [
        [_kv_label(r), str(r["block_size"]), _f(r["perplexity"], 2), f"{r['ppl_vs_auto']:.4f}x",
         _f(r["greedy_agreement"], 2), _f(r["max_abs_delta_logprob"], 3)]
        for r in data["rows"]
    ]  # fmt: skip
    out += _table(["KV cache", "block", "perplexity", "vs auto", "greedy agreement",
                   "max abs delta logprob"], rows)  # fmt: skip
    return out + ["", "Command: `python benchmarks/run_all.py --only kv_accuracy_trained`", ""]


def _spec_decode_section(data: dict[str, Any] | None) -> list[str]:
    """Prompt lookup and a draft model against no speculation (benchmarks/spec_decode.py)."""
    if data is None:
        return []
    one, specs = data["one_stream"], data["speculative_configs"]
    streams = next(k for k in data if k.startswith("streams_")).split("_")[1]
    many = data[f"streams_{streams}"]
    out = ["## Speculative decoding (prompt lookup, draft model)", ""]
    configs = "; ".join(f"`{json.dumps(c)}`".replace(str(Path.home()), "~") for c in specs.values())
    draft = f" The draft model is {data['draft']}." if data.get("draft") else ""
    out.append(
        f"{data['model']}, greedy, prompts that ask for a passage again ({data['prompts']} passages of "
        f"{data['passage_tokens']} tokens of Python's help text, then their first {data['seed_words']} "
        f"tokens), {data['max_tokens']} new tokens per request (the rest of the passage); "
        f"`--speculative-config` {configs} against no speculation, alternated {data['repeats']} times "
        f"in one process, medians.{draft} The bound is the tokens a verify step yields, "
        "max(1, E / cost): E = (1 - a^(k+1)) / (1 - a) for acceptance rate a, cost = a verify step's "
        "time (a step that checked drafts, a draft model's drafting included) over the plain engine's "
        "decode step; where E / cost < 1 the best is not to draft. Who drafts adapts (acceptance gate and measured "
        "step cost, the defaults; docs/serving.md)." + _spec_decode_spread(data) + " Measured " + data["environment"]["date"] + "."
        + (" 1-minute load average {} before, {} after (cores: {}).".format(*data["load_average"], data[
            "environment"].get("cpu_cores", "?")) if "load_average" in data else "")
    )
    out.append("")
    rows = [["1", "off", _f(one["off_tokens_per_s"]), "1.00x", "-", "-", "-", "-", "-", "-"]]
    for name in specs:
        m = one[name]
        rows.append(["1", name, _f(m["tokens_per_s"]), f"{m['speedup']:.2f}x", _pct(m["acceptance_rate"]),
                     _f(m["tokens_per_target_step"], 2), _pct(m.get("verify_step_share")),
                     f"{m['step_cost']:.2f}x" if m["step_cost"] else "-",
                     f"{m['bound']:.2f}x" if m["bound"] else "-", _pct(m["efficiency"])])  # fmt: skip
    rows.append([streams, "off", _f(many["off_tokens_per_s"]), "1.00x", "-", "-", "-", "-", "-", "-"])
    for name in specs:
        m = many[name]
        rows.append([streams, name, _f(m["tokens_per_s"]), f"{m['ratio']:.2f}x",
                     _pct(m.get("acceptance_rate")), _f(m.get("tokens_per_target_step"), 2), "-", "-", "-", "-"])  # fmt: skip
    out += _table(["streams", "speculation", "tok/s", "ratio", "acceptance", "tokens/step", "verify steps",
                   "verify cost", "bound", "of bound"], rows)  # fmt: skip
    return out + ["", "Command: `" + data.get("command", "python benchmarks/spec_decode.py") + "`", ""]


def _spec_decode_spread(data: dict[str, Any]) -> str:
    """How far the plain engine's own runs spread: ratios within it are noise."""
    runs = data.get("runs", {}).get("off")
    if not runs:
        return ""
    parts = []
    for kind, label in (("one", "one stream"), ("many", f"{data['streams']} streams")):
        tps = [r["tokens_per_s"] for r in runs[kind]]
        parts.append(f"{_f(min(tps))}-{_f(max(tps))} tok/s ({label})")
    return (" The plain engine's own runs spread " + " and ".join(parts)
            + ": a ratio within that spread is the machine, not the method.")


def _spec_decode_peer_section(data: dict[str, Any] | None) -> list[str]:
    """Speculation on paged-server and llama-server, one stream (benchmarks/spec_decode_peer.py)."""
    if data is None:
        return []
    out = ["### Against llama.cpp's speculative decoding", ""]
    paged = "; ".join(f"{m} `{json.dumps(c)}`".replace(str(Path.home()), "~")
                      for m, c in data["paged_speculative_configs"].items())  # fmt: skip
    theirs = "; ".join(f"{m} `{f}`" for m, f in data["llamacpp_flags"].items())
    out.append(
        f"One stream over HTTP, the prompts above ({data['prompts']} passages of {data['passage_tokens']} "
        f"tokens asked for again, {data['max_tokens']} greedy tokens each, sent {data['rounds']} times a "
        f"run), {data['model']} and its draft {data['draft']}; llama.cpp serves both converted to GGUF "
        f"{data['outtype']} by its own converter, one slot. paged: {paged}. llama.cpp: {theirs}. Every "
        f"(server, method) started fresh and warmed, order rotating, {data['repeats']} repeats, medians. "
        "Measured " + data["environment"]["date"] + "."
        + (" 1-minute load average {} before, {} after.".format(*data["load_average"])
           if "load_average" in data else "")
    )  # fmt: skip
    out.append("")
    rows = []
    for method, r in data["ratios"].items():
        ours, theirs_ = data["by_peer"][f"paged {method}"], data["by_peer"][f"llama.cpp {method}"]
        rows.append([method, _f(ours["output_tokens_per_s"]), f"{r['paged_vs_off']:.2f}x",
                     _f(theirs_["output_tokens_per_s"]), f"{r['llamacpp_vs_off']:.2f}x",
                     f"**{r['paged_vs_llamacpp']:.2f}x**"])  # fmt: skip
    out += _table(["speculation", "paged tok/s", "vs paged off", "llama.cpp tok/s", "vs llama.cpp off",
                   "paged / llama.cpp"], rows)  # fmt: skip
    return out + ["", "Command: `" + data["command"].strip() + "`", ""]


def _sliding_window_section(sw: dict[str, Any] | None) -> list[str]:
    out = ["## Sliding-window layers: blocks given back (hybrid KV cache)", ""]
    if sw is None:
        return out + ["_Not run yet._", ""]
    out += [
        f"KV blocks one sequence holds once computed, {sw['layout']}, blocks of {sw['block_size']}, "
        "measured on `device=\"meta\"` pools: the hybrid KV cache manager (sliding layers in their own "
        "KV cache groups, freeing blocks that leave the window) against one group for every layer "
        "(`--disable-hybrid-kv-cache-manager`). Layer-blocks = blocks x layers per block; the formula is "
        "(global layers x L + local layers x min(L, W)) / block size. "
        f"Sequences = how many prompts of that length are admitted into {sw['budget_bytes'] / 2**30:.0f} GiB "
        "of KV until the pool refuses one (a prompt's blocks are taken in every group at admission and the "
        "sliding groups' ones freed as it is computed, so the last admission needs L tokens in every group). "
        "`python benchmarks/run_all.py --only sliding_window` (or `paged-server bench --capacity`) reruns it.",
        "",
    ]
    int4 = sw.get("int4_block_size") is not None and "hybrid_int4_sequences" in sw["rows"][0]
    if int4:
        out += [
            f"The int4 columns: the hybrid pool storing `--kv-cache-dtype int4` in blocks of "
            f"{sw['int4_block_size']} in the same bytes, and its sequences over the 16-bit one-group "
            "pool's.",
            "",
        ]
    extra = ["sequences: hybrid int4", "hybrid int4 vs one group"] if int4 else []
    out += _table(
        ["tokens", "formula (layer-blocks)", "hybrid", "one group", "bytes saved",
         "sequences: hybrid", "sequences: one group", *extra],  # fmt: skip
        [
            [_f(r["tokens"]), _f(r["formula_layer_blocks"]), _f(r["hybrid_layer_blocks"]),
             _f(r["one_group_layer_blocks"]), f"{r['saving']:.2f}x", _f(r["hybrid_sequences"]),
             _f(r["one_group_sequences"]),
             *([_f(r["hybrid_int4_sequences"]), f"{r['int4_hybrid_vs_one_group']:.2f}x"] if int4 else [])]  # fmt: skip
            for r in sw["rows"]
        ],
    )
    return out + [""]


def _kv_dtype_section(kv: dict[str, Any] | None, tput: dict[str, Any] | None) -> list[str]:
    out = ["## KV cache dtype: 8-bit caches at equal KV bytes", ""]
    if kv is None and tput is None:
        return out + ["_Not run yet._", ""]
    if kv is not None:
        cap = kv["capacity"]
        s = cap["settings"]
        lay = s["layout"]
        out += [
            f"`--kv-cache-dtype`: capacity measured on real paged pools sized by bytes "
            f"({s['budget_bytes'] / 2**30:.0f} GiB of KV, {lay['name']} layout: {lay['num_layers']} layers, "
            f"{lay['num_kv_heads']} kv heads x {lay['head_dim']}, blocks of {s['block_size']}), sequences of "
            f"{s['avg_len']} tokens admitted until the pool refuses. int8 stores a float16 scale per token and "
            "kv head beside the codes (counted here); fp8 uses a per-tensor scale of 1.0 (nothing stored). "
            "With `calculate_kv_scales` both keep one float32 scale per layer and kv head, calibrated at "
            "start-up (nothing per token).",
            "",
        ]
        out += _table(
            ["model dtype", "kv_cache_dtype", "stored as", "bytes / token", "blocks", "tokens",
             "sequences", "tokens vs auto"],  # fmt: skip
            [
                [r["model_dtype"], _kv_label(r), r["stored_as"], _f(r["bytes_per_token"]),
                 _f(r["num_blocks"]), _f(r["tokens"]), _f(r["sequences"]),
                 f"{r['tokens_vs_auto']:.3f}x"]  # fmt: skip
                for r in cap["rows"]
            ],
        )
        out += [
            "",
            "Accuracy against `auto` on the same model (float32 weights, reference attention): greedy "
            "agreement = share of the greedy tokens generated before the first one that differs; max "
            "|delta logprob| = largest change of a chosen token's logprob before that point; perplexity of a "
            "fixed English text (`pydoc_data.topics`) fed in 64-token chunks through a pool of that dtype. "
            "Both models have random weights: their next-token distributions are nearly flat (perplexity "
            "close to the vocabulary size), so near-ties flip greedy choices far more easily than in a trained "
            "model; compare the dtypes with each other rather than reading the agreement as a trained "
            "model's. `paged-server bench --capacity` prints the capacity table; "
            "`python benchmarks/run_all.py --only kv_dtype` reruns both tables.",
            "",
        ]
        rows = []
        for table in kv["accuracy"]:
            st = table["settings"]
            for r in table["rows"]:
                rows.append([
                    table["model"], _kv_label(r), _pct(r["greedy_agreement"]),
                    f"{r['max_abs_delta_logprob']:.4f}", f"{r['perplexity']:,.2f}",
                    f"{st['num_prompts']} x {st['max_tokens']} tokens, text {st['text_tokens']} tokens",
                ])  # fmt: skip
        out += _table(
            ["model", "kv_cache_dtype", "greedy agreement", "max abs delta logprob", "perplexity", "sample"],
            rows,
        )
        out.append("")
    if tput is not None:
        w = tput["workload"]
        out += [
            f"Throughput, `{w['name']}` workload on the {tput['model']['name']} model, paged engine, every "
            f"kv_cache_dtype in the KV bytes of {tput['kv_budget']['tokens']:,} model-dtype token slots "
            f"({tput['environment']['hardware']}, {tput['environment']['date']}):",
            "",
        ]
        out += _table(
            ["kv_cache_dtype", "tokens/s", "peak running", "TTFT ms p50/p90/p99", "ITL ms p50/p90/p99",
             "vs auto"],  # fmt: skip
            [
                [f"`{r['kv_cache_dtype']}`", _f(r["tokens_per_s"]), _f(r["peak_running"]),
                 _lat(r["ttft_ms"]), _lat(r["itl_ms"]), f"{r['vs_auto']:.2f}x" if r["vs_auto"] else "-"]  # fmt: skip
                for r in tput["runs"]
            ],
        )
        out.append("")
    return out


def _sweep_section(sweep: dict[str, Any] | None, images: Path, docs: Path) -> list[str]:
    out = ["## Throughput vs batch size", ""]
    if sweep is None:
        return out + ["_Not run yet._", ""]
    img = plot_batch_sweep(sweep, images / "throughput_vs_batch.png")
    out += [
        f"- Model: {_model_line(sweep['model'])}.",
        f"- Workload: {_workload_line(sweep['workload'])}",
        "- Paged: always the 8 x 4,096 token budget, `max_batch_size` varied. Contiguous: `max_batch_size` rows of "
        "4,096 tokens each, so above 8 it gets *more* KV memory than the budget (its batch size is its memory).",
        "",
        f"![throughput vs batch size]({img.relative_to(docs).as_posix()})",
        "",
    ]
    rows = []
    for r in sweep["runs"]:
        s = r["settings"]
        rows.append(
            [
                s["kv_cache_backend"],
                _f(s["max_batch_size"]),
                _f(s["kv_capacity_tokens"]),
                _f(r["tokens_per_s"]),
                _lat(r["ttft_ms"]),
                _lat(r["itl_ms"]),
                _f(r["peak_running"]),
                _pct(r["peak_kv_usage"]),
                _f(r["preemptions"]),
            ]
        )
    out += _table(
        [
            "backend",
            "max_batch_size",
            "KV token slots",
            "tokens/s",
            "TTFT ms p50/p90/p99",
            "ITL ms p50/p90/p99",
            "peak running",
            "peak KV usage",
            "preemptions",
        ],
        rows,
    )
    return out + [""]


def _timeline_section(seed: dict[str, Any] | None, images: Path, docs: Path) -> list[str]:
    out = ["## KV usage over time (seed workload)", ""]
    runs = [r for r in (seed or {}).get("runs", []) if r.get("timeline")]
    if not runs:
        return out + ["_Not run yet._", ""]
    img = plot_kv_timeline(runs, images / "kv_usage_timeline.png")
    out += [
        "Fraction of the pool's token slots allocated to sequences (solid) and holding real tokens (dashed), "
        "sampled after every engine step of the seed-workload runs above; below, running sequences. "
        "The contiguous pool allocates a whole 4,096-token row per sequence, so it is full while holding far fewer real tokens; "
        "the paged pool allocates 16-token blocks as sequences grow.",
        "",
        f"![KV usage over time]({img.relative_to(docs).as_posix()})",
        "",
    ]
    return out


def _prefix_section(prefix: dict[str, Any] | None, images: Path, docs: Path) -> list[str]:
    out = ["## Prefix caching on a shared system prompt", ""]
    if prefix is None:
        return out + ["_Not run yet._", ""]
    img = plot_prefix_cache(prefix, images / "prefix_cache.png")
    out += [
        f"- Model: {_model_line(prefix['model'])}.",
        f"- Workload: {_workload_line(prefix['workload'])}",
        "- Paged engine, same settings, `enable_prefix_caching` off then on. Hit rate = prompt tokens served from "
        "the cache / prompt tokens looked up (the engine's `prefix_cache_hits_total / prefix_cache_queries_total`).",
        "",
        f"![prefix caching]({img.relative_to(docs).as_posix()})",
        "",
    ]
    rows = [
        [
            r["config"],
            _pct(r["prefix_cache_hit_rate"]),
            _f(r["tokens_per_s"]),
            _f(r["seconds"], 2),
            _lat(r["ttft_ms"]),
            _lat(r["itl_ms"]),
            _f(r["peak_running"]),
        ]
        for r in prefix["runs"]
    ]
    out += _table(
        [
            "configuration",
            "hit rate",
            "tokens/s",
            "seconds",
            "TTFT ms p50/p90/p99",
            "ITL ms p50/p90/p99",
            "peak running",
        ],
        rows,
    )
    return out + [""]


def _micro_section(micro: dict[str, Any] | None) -> list[str]:
    out = ["## Kernel microbenchmarks", ""]
    if micro is None or not micro.get("benchmarks"):
        return out + ["_No pytest-benchmark results (benchmarks/results/microbench.json) yet._", ""]
    mi = micro.get("machine_info", {})
    out += [
        f"pytest-benchmark, {micro.get('datetime', '?')[:16]}, {mi.get('cpu', {}).get('brand_raw', mi.get('processor', '?'))}. "
        "Times per call; compare rows of one group (same shapes), not across groups.",
        "",
    ]
    rows = []
    for b in sorted(micro["benchmarks"], key=lambda b: (b.get("group") or "", b["name"])):
        st = b["stats"]
        rows.append(
            [
                b.get("group") or "-",
                f"`{b['name']}`",
                f"{st['median'] * 1e3:.3f}",
                f"{st['mean'] * 1e3:.3f}",
                f"{st['stddev'] * 1e3:.3f}",
                str(st["rounds"]),
                ", ".join(f"{k}={_g(v)}" for k, v in (b.get("extra_info") or {}).items()) or "-",
            ]
        )
    header = ["group", "benchmark", "median ms", "mean ms", "stddev ms", "rounds", "extra_info"]
    out += _table(header, rows)
    return out + [""]


def _gpu_section(gpu: dict[str, Any] | None) -> list[str]:
    """The last ``nox -s gpu`` run: its tests and targets (the whole table is
    ``benchmarks/results/gpu.md``, written by ``benchmarks/gpu_report.py``)."""
    if gpu is None:
        return []
    tests = gpu["tests"]
    rows = [[t["target"], f"{_f(t['value'], 2)} {t['unit']}", "yes" if t["met"] else "no"]
            for t in gpu["targets"]]  # fmt: skip
    failed = "".join(f"\n- failed: `{name}`" for name in tests["failures"])
    return [
        "## Triton kernels on a GPU (`nox -s gpu`)",
        "",
        f"{gpu['device']}; torch {gpu['torch']}, Triton {gpu['triton']}. Tests on the GPU: "
        f"{tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped.{failed}",
        "",
        *_table(["target", "measured", "met"], rows),
        "",
        "Every kernel benchmark, the quantized GEMM's table and the compile matrix for this GPU: "
        "[`benchmarks/results/gpu.md`](../benchmarks/results/gpu.md).",
        "",
    ]


def _gpu_serving_section(r: dict[str, Any] | None) -> list[str]:
    """The end-to-end GPU run (``benchmarks/gpu_serving.py``, issue 59): an
    8B-shaped model served, against the roofline and transformers."""
    if r is None:
        return []
    decode = r.get("decode", {})
    hf = r.get("vs_transformers_generate_batch", {})
    rows = [[s, _f(d.get("decode_tokens_per_s")), _f(d.get("roofline_tokens_per_s")),
             _pct(d.get("roofline_fraction")), _f(d.get("output_tokens_per_s")),
             "-" if s not in hf else f"{hf[s]:.2f}x"] for s, d in decode.items()]  # fmt: skip
    ttft = r.get("ttft_2k", {})
    kernel = r.get("prefill_kernel", {})
    krows = [[case, _f(k["triton_tflops"]), _f(k["sdpa_tflops"]), f"{k['ratio']:.2f}x"]
             for case, k in kernel.items()]  # fmt: skip
    status = ", ".join(f"{p} {s['status']} ({s['seconds']:.0f} s)" for p, s in r["phases"].items())
    static = r.get("ttft_vs_transformers_static")
    return [
        "## An 8B-shaped model served on a GPU (`benchmarks/gpu_serving.py`)",
        "",
        *([f"**{r['note']}**", ""] if r.get("note") else []),
        f"{r['device']}, {r['started']}, {r['seconds']:.0f} s; random Llama-3.1-8B-shaped bf16 "
        f"weights, `LLM` with a GPU user's defaults. Copy-kernel bandwidth: "
        f"{_f(r.get('hbm_bandwidth_GBps'))} GB/s. Phases: {status}.",
        "",
        *_table(["streams", "decode tok/s", "HBM roofline tok/s", "of roofline",
                 "tok/s (whole run)", "vs transformers generate_batch"], rows),  # fmt: skip
        "",
        _decode_method(decode),
        "",
        f"TTFT of {ttft.get('prompt_tokens', '-')}-token prompts: p50 {_f(ttft.get('p50_ms'))} ms "
        f"({_pct(ttft.get('roofline_fraction'))} of the FLOP roofline); against transformers' "
        f"static-cache generate: {'-' if static is None else f'{static:.2f}x'} its TTFT.",
        "",
        *_gpu_serving_latency(r),
        *_table(["prefill kernel case", "Triton TFLOP/s", "SDPA TFLOP/s", "Triton vs SDPA"], krows),
        "",
    ]


def _decode_method(decode: dict[str, Any]) -> str:
    """How "decode tok/s" was taken: runs since issue 59's fix repeat the
    prompts (prefix hits) so all streams decode together; older ones took
    the cold run's staggered steps."""
    if any("cold_decode_tokens_per_s" in d for d in decode.values()):
        return ("Decode tok/s: the same prompts run again as prefix-cache hits, so every "
                "stream decodes in every step; the whole run's tok/s is the cold run "
                "(prefill and decode interleaved), the one set against transformers.")  # fmt: skip
    return ("Decode tok/s here is the cold run's, from the step every stream had its first "
            "token: chunked prefill staggers the streams, so those steps held fewer than the "
            "streams named (at 256, no step held them all) and the fraction of the roofline, "
            "which assumes them all, is understated.")  # fmt: skip


def _gpu_serving_latency(r: dict[str, Any]) -> list[str]:
    """One stream's inter-token latency against the weight read, and the HTTP phase."""
    out = []
    one = r.get("decode", {}).get("1", {})
    hf_itl = r.get("hf_static", {}).get("itl_ms")
    if one.get("decode_tokens_per_s"):
        out += [f"One stream: ITL {_f(1e3 / one['decode_tokens_per_s'])} ms, "
                f"{one.get('itl_over_weight_read', 0):.2f}x the time to read the weights once; "
                f"transformers' static-cache generate: {_f(hf_itl)} ms.", ""]  # fmt: skip
    for streams, p in r.get("step_profile", {}).items():
        top = ", ".join(f"`{k['name'][:40]}` {k['ms_per_step']:.2f} ms" for k in p["top"][:4])
        busy = ("" if p.get("kernel_ms_per_step") is None else
                f", kernels {_f(p['kernel_ms_per_step'], 2)} ms of it "
                f"({_pct(p['device_busy_fraction'])} busy, {_f(p['kernels_per_step'], 0)} launches)")  # fmt: skip
        out += [f"Decode step profile at {streams} stream(s): {_f(p['wall_ms_per_step'], 2)} ms per "
                f"step{busy}; most time: {top}.", ""]  # fmt: skip
    serve = r.get("serve")
    if serve:
        out += [f"Over HTTP (`paged-server serve`, {serve['streams']} streamed completions at once): "
                f"{_f(serve['output_tokens_per_s'])} tok/s, TTFT p50 {_f(serve['ttft_p50_ms'])} ms; "
                f"a {_f(r.get('ttft_2k', {}).get('prompt_tokens'))}-token prompt's TTFT "
                f"{_f(serve.get('ttft_2k_cold_ms'))} ms cold, "
                f"{_f(serve.get('ttft_2k_prefix_hit_ms'))} ms as a prefix-cache hit.", ""]  # fmt: skip
    return out


def _history_section(results: Path) -> list[str]:
    out = ["## History (SERVING_LOG)", ""]
    path = results / "history.jsonl"
    if not path.is_file():
        return out + ["_No full runs recorded yet._", ""]
    lines = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    out += [
        "One row per configuration and full `run_all.py` run, newest first (benchmarks/results/history.jsonl).",
        "",
    ]
    rows = [
        [
            h["date"],
            h["hardware"],
            h["benchmark"],
            h["model"],
            f"{h['workload']} x{h['num_requests']}",
            h["config"],
            _f(h["tokens_per_s"]),
            _f(h["ttft_p50_ms"]),
            _f(h["itl_p50_ms"]),
            _f(h["peak_running"]),
            _pct(h["peak_kv_usage"]),
            _f(h["preemptions"]),
        ]
        for h in reversed(lines)
    ]
    out += _table(
        [
            "date",
            "hardware",
            "benchmark",
            "model",
            "workload",
            "configuration",
            "tokens/s",
            "TTFT p50 ms",
            "ITL p50 ms",
            "peak running",
            "peak KV usage",
            "preemptions",
        ],
        rows,
    )
    return out + [""]


def _serving_section(data: dict[str, Any] | None) -> list[str]:
    out = ["## Serving latency: inter-token latency while prompts arrive", ""]
    if data is None:
        return out + ["_Not run yet: `python benchmarks/run_all.py` writes it._", ""]
    spec, env = data["plan"], data["environment"]
    out += [
        f"`paged-server bench-serve` on the embedded model, in-process server on loopback: workload "
        f"`{spec['workload']}` ({spec['num_requests']} requests, Poisson arrivals at {spec['request_rate']} "
        "requests/s, streamed, EOS ignored), once per step token budget (`--max-num-batched-tokens`). Every "
        "step is one forward pass; a step that also prefills a prompt chunk takes longer, and each running "
        "stream waits for it. Running = the server's `paged:num_requests_running`, sampled every 0.5 s. "
        f"Measured {env['date']} on {env['hardware']}.",
        "",
    ]
    rows = []
    for r in data["runs"]:
        itl = r["itl_ms"]
        label = f"{r['budget']}" + (" (CPU default)" if r.get("budget_is_default") else "")
        rows.append(
            [
                label,
                _f(r["running"]["mean"]),
                _f(r["running"]["peak"]),
                _lat(itl),
                f"{itl['p99'] / itl['p50']:.2f}x" if itl["p50"] else "-",
                _lat(r["ttft_ms"]),
                _f(r["output_tokens_per_s"]),
                f"{r['completed']}/{r['num_requests']}",
            ]
        )
    out += _table(
        [
            "step token budget",
            "mean running",
            "peak running",
            "ITL ms p50/p90/p99",
            "ITL p99 / p50",
            "TTFT ms p50/p90/p99",
            "output tokens/s",
            "completed",
        ],
        rows,
    )
    out.append("")
    return out


def _llamacpp_section(data: dict[str, Any] | None, quantized: bool = False) -> list[str]:
    """The llama.cpp peer results; ``quantized``: llamacpp_quantized.json, where
    each paged ``--quantization`` peer is compared with its own GGUF type."""
    if quantized:
        out = ["## llama.cpp with quantized weights: paged int8 / int4 against Q8_0 / Q4_0 GGUF", ""]
        todo = "`python benchmarks/llamacpp_peer.py --quantized`"
    else:
        out = ["## llama.cpp as a peer: the same model and requests in `llama-server`", ""]
        todo = "`python benchmarks/llamacpp_peer.py`"
    if data is None:
        return out + [
            "_Not run yet: `python benchmarks/llamacpp_peer.py --build` once (compiles llama.cpp, ~15+ min on "
            f"2 cores), then {todo}; see Reproduce._",
            "",
        ]
    env, plan, lcpp, w = data["environment"], data["plan"], data["llamacpp"], data["workload"]
    # which paged peer each llama.cpp peer is compared with (older files: plain paged for all)
    partner = {theirs: ours for ours, theirs in data.get("pairs", [])}
    compared = {"paged", *partner.values()}  # the rows the column compares with, so "-" there
    agree = ", ".join(
        f"{a.get('paged_peer', 'paged')} vs {t} {a['agree']}/{a['of']}" if quantized else f"{t} {a['agree']}/{a['of']}"
        for t, a in data["agreement"].items()
    )
    sizes = ", ".join(f"{t} {b / 1e6:.0f} MB" for t, b in lcpp["gguf_bytes"].items())
    paged_line = (
        "`paged-server serve --quantization METHOD` (otherwise defaults: weight-only int8 per channel, int4 in groups "
        "of 128)"
        if quantized
        else "`paged-server serve` with defaults"
    )
    out += [
        f"{_model_line(data['model'])}, converted to GGUF ({sizes}) by llama.cpp's own `convert_hf_to_gguf.py` "
        f"(llama.cpp vendored in the llama-cpp-python {lcpp['version']} sdist, built CPU-only: "
        f"`{shlex.join(lcpp['flags'])}`). Greedy text (32 tokens) of the first prompts identical to paged's, "
        f"per GGUF type: {agree}"
        + (" (the formats round weights differently, so a random model's near-flat logits part ways: reported, "
           "not required)." if quantized else "."),
        "",
        f"Requests: {w['prompt_tokens']['min']}-{w['prompt_tokens']['max']} token-id prompts, "
        f"{w['max_tokens']['max']} new tokens, EOS ignored, greedy, streamed to `/v1/completions`; closed loop "
        f"(each of N streams sends its next request when the last ends), {plan['num_requests']} requests per run "
        f"({plan['single_stream_requests']} at 1 stream). {paged_line} against "
        f"`llama-server {lcpp['server_args']}`; each run starts its server fresh and warms it with one request; "
        f"peer order rotates per run; medians of {plan['repeats']} runs. **Busy cores** = CPU seconds of the "
        "server's process tree / wall seconds; **other load** = the rest of the machine's busy cores "
        "(not the server, not the client): the machine is shared, so runs with other load are slower. "
        f"Measured {env['date']} on {env['hardware']}.",
        "",
    ]  # fmt: skip
    rows = []
    for row in data["table"]:
        # quantized: each pair's two rows together (the JSON's keys come back sorted)
        order = [p for pair in data["pairs"] for p in pair] if quantized else list(row["medians"])
        for peer in order:
            m = row["medians"][peer]
            theirs = m["output_tokens_per_s"]
            ours = row["medians"].get(partner.get(peer, "paged"), {}).get("output_tokens_per_s")
            rows.append(
                [
                    str(row["concurrency"]),
                    peer,
                    _f(theirs),
                    _f(m["ttft_p50_ms"]),
                    f"{_f(m['itl_p50_ms'])} / {_f(m['itl_p99_ms'])}",
                    _f(m["busy_cores"], 2),
                    _f(m["other_cores"], 2),
                    "-" if peer in compared or not theirs or not ours else f"{ours / theirs:.2f}x",
                ]
            )
    out += _table(
        ["streams", "server", "output tokens/s", "TTFT p50 ms", "ITL p50 / p99 ms", "busy cores",
         "other load (cores)", "its paged peer / this" if quantized else "paged / this"],
        rows,
    )  # fmt: skip
    if quantized:
        best = [
            f"{key}: " + ", ".join(f"{row['concurrency']} streams {_f(row['ratios'][key], 2)}x" for row in data["table"])
            for key in data["table"][0]["ratios"]
        ]
        out += ["", f"Output tokens/s ratios: {'; '.join(best)}.", ""]
    else:
        best = [
            f"{row['concurrency']}: {_f(row['ratios']['paged / best llama.cpp'], 2)}x" for row in data["table"]
        ]
        out += ["", f"paged / best llama.cpp output tokens/s, by streams: {', '.join(best)}.", ""]
    out += [f"Command: `{data['command']}`", ""]
    return out


def _summary_bullets(title: str, data: dict[str, Any]) -> list[str]:
    by = {r["config"]: r for r in data["runs"]}
    p, c = by.get("paged"), by.get("contiguous")
    if p is None:
        return []
    w, b = data["workload"], data["kv_budget"]
    out = []
    if c is not None:
        out.append(
            f"- {title} ({w['num_requests']} requests in one burst), equal KV bytes ({b['rows']} x {b['max_model_len']} "
            f"token slots): the paged engine ran **{p['peak_running']}** sequences at once (contiguous: "
            f"**{c['peak_running']}**); at its peak **{_pct(p['peak_kv_usage'])}** of the token slots it had allocated "
            f"held real tokens (contiguous: {_pct(c['peak_kv_usage'])}); {p['preemptions']} preemptions."
        )
    ratios = [
        f"{label} **{p['tokens_per_s'] / by[key]['tokens_per_s']:.2f}x**"
        for key, label in (
            ("contiguous", "vs contiguous"),
            ("hf_generate_batch", "vs transformers generate_batch"),
            ("hf_static_generate", "vs transformers static generate"),
        )
        if key in by and by[key]["tokens_per_s"]
    ]
    if ratios:
        bound = ""
        if p.get("linear_share") is not None:
            bound = (
                f" ({_pct(p['linear_share'])} of its time in the linear layers, i.e. tokens/s at "
                f"{_pct(p['linear_share'])} of the linear-layers-only bound)"
            )
        out.append(
            f"- {title}: paged throughput {_f(p['tokens_per_s'])} tokens/s{bound}; "
            + ", ".join(ratios)
            + "."
        )
    return out


def _summary(results: Path) -> list[str]:
    out = ["## Summary", ""]
    for key, title in (
        ("seed_embedded", "Seed workload, embedded model"),
        ("seed_100m_full", "Seed workload (full size), ~100M Llama"),
        ("seed_100m", "Seed workload (scaled), ~100M Llama"),
        ("nano_vllm_embedded", "nano-vllm workload (scaled), embedded model"),
    ):
        data = _load(results, key)
        if data is not None:
            out += _summary_bullets(title, data)
    prefix = _load(results, "prefix_cache")
    if prefix is not None:
        runs = {r["settings"]["enable_prefix_caching"]: r for r in prefix["runs"]}
        if True in runs and False in runs:
            on, off = runs[True], runs[False]
            out.append(
                f"- Shared system prompt: prefix caching served **{_pct(on['prefix_cache_hit_rate'])}** of prompt tokens "
                f"from the cache; TTFT p50 {_f(on['ttft_ms']['p50'])} ms vs {_f(off['ttft_ms']['p50'])} ms without, "
                f"throughput {on['tokens_per_s'] / off['tokens_per_s']:.2f}x."
            )
    serving = _load(results, "serving_latency")
    if serving is not None:
        parts = [
            f"{r['itl_ms']['p99'] / r['itl_ms']['p50']:.1f}x at a {r['budget']}-token step budget"
            + (" (the CPU default)" if r.get("budget_is_default") else "")
            for r in serving["runs"]
            if r["itl_ms"]["p50"]
        ]
        out.append(
            "- Serving (bench-serve, ~"
            + _f(serving["runs"][-1]["running"]["mean"])
            + " streams running): ITL p99 / p50 "
            + ", ".join(parts)
            + "."
        )
    cap = _load(results, "capacity")
    if cap is not None and cap["rows"]:
        r = min(cap["rows"], key=lambda r: r["avg_len_target"])
        out.append(
            f"- Capacity at equal KV bytes (measured on the pools): at average length {r['avg_len_target']} the paged "
            f"pool holds **{r['paged']}** sequences, the contiguous pool {r['contiguous']} ({r['ratio']:.1f}x)."
        )
    kv = _load(results, "kv_dtype")
    if kv is not None:
        rows = {
            (r["model_dtype"], r["kv_cache_dtype"], bool(r.get("calculate_kv_scales"))): r
            for r in kv["capacity"]["rows"]
        }
        fp8, int8 = rows.get(("bfloat16", "fp8", False)), rows.get(("bfloat16", "int8", False))
        static = rows.get(("bfloat16", "int8", True))
        if fp8 and int8:
            out.append(
                f"- KV cache dtype at equal KV bytes (bf16 model): `fp8` holds **{fp8['tokens_vs_auto']:.2f}x** "
                f"the tokens of `auto`, `int8` **{int8['tokens_vs_auto']:.2f}x** (its per-token scales cost the rest)"
                + (f", `int8` with `calculate_kv_scales` **{static['tokens_vs_auto']:.3f}x**." if static else ".")
            )
    sw = _load(results, "sliding_window")
    if sw is not None and sw["rows"]:
        r = max(sw["rows"], key=lambda r: r["tokens"])
        out.append(
            f"- Sliding-window layers (Gemma 3 1B layout, {r['tokens']:,} tokens): the hybrid KV cache holds "
            f"**{r['saving']:.2f}x** fewer KV bytes per sequence than one group for all layers "
            f"({r['hybrid_sequences']} vs {r['one_group_sequences']} sequences in the same memory)."
        )
    out += [
        "",
        "Reading these numbers: on a CPU a forward pass costs roughly in proportion to the tokens in it, so running "
        "more sequences at once buys less throughput than on a GPU, where a decode step is bound by reading the "
        "weights and a bigger batch is nearly free. The concurrency, KV-usage and capacity results do not depend on "
        "the hardware; the throughput ratios do.",
        "",
    ]
    return out if len(out) > 6 else ["## Summary", "", "_No engine results yet._", ""]


def write_page(results: Path, docs: Path) -> Path:
    """Write ``docs/benchmarks.md`` and ``docs/images/*.png`` from ``results``."""
    images = docs / "images"
    seed = _load(results, "seed_embedded")
    s100 = _load(results, "seed_100m")
    env = (seed or s100 or _load(results, "capacity") or {}).get("environment", {})
    lines = [
        "# Benchmarks",
        "",
        "_Generated by `nox -s bench` (`python benchmarks/run_all.py`) from `benchmarks/results/*.json`; do not edit by "
        "hand. Every number here is one the run printed as a JSON line._",
        "",
        f"Latest run: {env.get('date', '?')} on {env.get('hardware', '?')}; Python {env.get('python', '?')}, "
        f"torch {env.get('torch', '?')}, transformers {env.get('transformers', '?')}, {env.get('torch_threads', '?')} torch threads.",
        "",
        "Definitions: **tokens/s** = output tokens / wall seconds from the burst to the last token (model loading and "
        "engine construction excluded). **TTFT** = first token time since the burst (all requests arrive at t=0, so it "
        "includes queueing). **ITL** = gap between consecutive tokens of one request. **Peak KV usage** = tokens held / "
        "token slots allocated to sequences, at the step holding the most tokens. **Peak pool allocated** = highest share "
        "of all token slots allocated. **Time in linear layers** = share of our engine's wall time spent inside the "
        "model's `nn.Linear` layers: the matrix products any engine must run, so tokens/s divided by the "
        "linear-layers-only bound (timed by module hooks when eager; for the compiled forward, the self time of the "
        "GEMM ops torch's profiler records, a floor since the profiler's own cost counts as other time). Ratios divide the row's tokens/s by the column's, measured in the same run. "
        "Every configuration runs the same weights in the dtype `--dtype auto` picks (on a CPU, bfloat16 where it "
        "has AMX / AVX512-BF16, else float32); ours uses the reference "
        "attention path (on a CPU, its C decode kernel and SDPA for prompt chunks).",
        "",
    ]
    lines += _summary(results)
    lines += _comparison_section(
        "Seed workload, embedded model",
        seed,
        "48 requests in one burst, prompts of 128-384 tokens, 128-256 new tokens each, EOS ignored: "
        "each fits in 640 tokens, so a paged pool of 8 x 4,096 token slots holds all 48 at once "
        "where a contiguous one holds 8.",
    )
    lines += _timeline_section(seed, images, docs)
    lines += _comparison_section(
        "Seed workload, ~100M-parameter Llama (full size)",
        _load(results, "seed_100m_full"),
        "`paged-server bench --model-config 100m --workload seed`: the same burst of 48 at full "
        "size on a random ~100M-parameter Llama, against transformers' continuous batching and static "
        "`generate` (the contiguous pool is left out here to keep the run short).",
    )
    lines += _comparison_section(
        "Seed workload, ~100M-parameter Llama (scaled down for CPU)",
        s100,
        "A random ~100M-parameter Llama (`paged-server bench --model-config 100m`), so the "
        "model's compute dominates as it would with a real checkpoint; scaled down because CPU is slow.",
    )
    lines += _tensor_parallel_section(_load(results, "tensor_parallel"))
    lines += _comparison_section(
        "nano-vllm workload (scaled down for CPU)",
        _load(results, "nano_vllm_embedded"),
        "nano-vllm's benchmark shape (256 requests, 100-1,024 tokens in and out) is hours of "
        "CPU time; this is the scaled version named below.",
    )
    lines += _capacity_section(_load(results, "capacity"), images, docs)
    lines += _kv_dtype_section(_load(results, "kv_dtype"), _load(results, "kv_dtype_throughput"))
    lines += _kv_accuracy_trained_section(_load(results, "kv_accuracy_trained"))
    lines += _spec_decode_section(_load(results, "spec_decode"))
    lines += _spec_decode_peer_section(_load(results, "spec_decode_peer"))
    lines += _sliding_window_section(_load(results, "sliding_window"))
    lines += _sweep_section(_load(results, "batch_sweep"), images, docs)
    lines += _prefix_section(_load(results, "prefix_cache"), images, docs)
    lines += _kv_tiers_section(_load(results, "kv_tiers"))
    lines += _serving_section(_load(results, "serving_latency"))
    lines += _llamacpp_section(_load(results, "llamacpp_peer"))
    lines += _llamacpp_section(_load(results, "llamacpp_quantized"), quantized=True)
    lines += _micro_section(_load(results, "microbench"))
    lines += _gpu_section(_load(results, "gpu"))
    lines += _gpu_serving_section(_load(results, "gpu_serving"))
    lines += _history_section(results)
    info = _load(results, "run_info")
    timing = ""
    if info is not None:
        steps = ", ".join(f"{k} {v:.0f} s" for k, v in info["seconds"].items())
        timing = f"The last full `run_all.py` ({info['date']}) took {info['total_seconds']:.0f} s: {steps}."
    lines += [
        "## Reproduce",
        "",
        *([timing, ""] if timing else []),
        "```bash",
        "nox -s bench                                   # microbenchmarks + everything above (CPU: under 20 minutes)",
        "python benchmarks/run_all.py --quick           # smoke test into a temporary folder",
        "paged-server bench --workload seed             # one workload, all four configurations, JSON lines",
        "paged-server bench --model-config 100m --workload seed   # the ~100M model, full size",
        "paged-server bench --model-config 100m --workload seed --prompt-scale 0.5 --max-new-tokens-scale 0.25  # scaled",
        "paged-server bench-serve --num-requests 96 --request-rate 8   # serving latency, CPU default budget",
        "python benchmarks/llamacpp_peer.py --build --build-only   # once: llama.cpp from the llama-cpp-python sdist",
        "python benchmarks/llamacpp_peer.py --model-config 30m --concurrency 1,8,16,32   # paged vs llama-server",
        "python benchmarks/llamacpp_peer.py --quantized   # paged int8/int4 vs llama-server Q8_0/Q4_0, 100M model",
        "nox -s gpu                                     # on a CUDA machine: GPU tests, kernel benchmarks, gpu.md",
        "```",
        "",
    ]
    docs.mkdir(parents=True, exist_ok=True)
    page = docs / "benchmarks.md"
    page.write_text("\n".join(lines), encoding="utf-8")
    return page
