"""PNG plots for docs/benchmarks.md, drawn from the JSON results only.

Each function takes the parsed results (what run_all.py wrote to
benchmarks/results/) and a path, and writes one PNG with matplotlib's Agg
backend (no display needed). Nothing here measures anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {
    "paged": "#1f77b4",
    "contiguous": "#d62728",
    "hf_generate_batch": "#2ca02c",
    "hf_static_generate": "#9467bd",
}


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_capacity(capacity: dict[str, Any], path: Path) -> Path:
    """Max concurrent sequences vs average sequence length, both pools, equal KV bytes."""
    rows = capacity["rows"]
    s = capacity["settings"]
    x = [r["avg_len_target"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(
        x,
        [r["paged"] for r in rows],
        "o-",
        color=COLORS["paged"],
        label=f"paged ({s['num_blocks']} blocks x {s['block_size']})",
    )
    ax.plot(
        x,
        [r["contiguous"] for r in rows],
        "s-",
        color=COLORS["contiguous"],
        label=f"contiguous ({s['num_rows']} rows x {s['max_model_len']})",
    )
    for r in rows:
        ax.annotate(
            str(r["paged"]),
            (r["avg_len_target"], r["paged"]),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x])
    top = max(r["paged"] for r in rows)
    yticks = [
        2**k
        for k in range(0, 16)
        if 2 ** (k - 1) <= top and 2**k >= min(r["contiguous"] for r in rows) / 2
    ]
    ax.set_yticks(yticks, [str(v) for v in yticks])
    ax.minorticks_off()
    ax.set_xlabel("average sequence length (tokens)")
    ax.set_ylabel("max concurrent sequences (measured)")
    ax.set_title(f"Capacity at equal KV memory ({s['token_slots']} token slots)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_batch_sweep(sweep: dict[str, Any], path: Path) -> Path:
    """Output tokens/s vs max batch size for the paged and contiguous backends."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for backend in ("paged", "contiguous"):
        pts = sorted(
            (r["settings"]["max_batch_size"], r["tokens_per_s"])
            for r in sweep["runs"]
            if r["settings"]["kv_cache_backend"] == backend
        )
        if pts:
            ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], "o-", color=COLORS[backend], label=backend
            )
    ax.set_xscale("log", base=2)
    sizes = sorted({r["settings"]["max_batch_size"] for r in sweep["runs"]})
    ax.set_xticks(sizes, [str(v) for v in sizes])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("max_batch_size (running sequences)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(
        f"Throughput vs batch size ({sweep['workload']['name']} workload, {sweep['model']['name']})"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_kv_timeline(runs: list[dict[str, Any]], path: Path) -> Path:
    """KV token slots allocated and tokens held over time, plus running sequences."""
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(6.4, 5.2), sharex=True)
    for run in runs:
        tl = run["timeline"]
        cap = run["settings"]["kv_capacity_tokens"]
        t = [p["t"] for p in tl]
        color = COLORS.get(run["config"])
        ax.plot(
            t,
            [p["slots_allocated"] / cap for p in tl],
            "-",
            color=color,
            label=f"{run['config']}: allocated",
        )
        ax.plot(
            t,
            [p["tokens_held"] / cap for p in tl],
            "--",
            color=color,
            label=f"{run['config']}: tokens held",
        )
        ax2.plot(t, [p["running"] for p in tl], "-", color=color, label=run["config"])
    ax.set_ylabel("fraction of KV token slots")
    ax.set_ylim(0, 1.05)
    ax.set_title("KV usage over time (seed workload)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax2.set_xlabel("seconds since the burst")
    ax2.set_ylabel("running sequences")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=8)
    return _save(fig, path)


def plot_prefix_cache(prefix: dict[str, Any], path: Path) -> Path:
    """TTFT percentiles with and without prefix caching, and the hit rate."""
    runs = {r["settings"]["enable_prefix_caching"]: r for r in prefix["runs"]}
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(8.0, 3.8), gridspec_kw={"width_ratios": [2, 1]})
    labels = ["p50", "p90", "p99"]
    width = 0.38
    for i, (flag, name, color) in enumerate(
        ((False, "caching off", "#7f7f7f"), (True, "caching on", COLORS["paged"]))
    ):
        if flag in runs:
            vals = [runs[flag]["ttft_ms"][k] or 0 for k in labels]
            ax.bar(
                [j + (i - 0.5) * width for j in range(len(labels))],
                vals,
                width,
                label=name,
                color=color,
            )
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("Time to first token, shared system prompt")
    ax.legend(loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)
    rates = [
        (name, (runs[flag]["prefix_cache_hit_rate"] or 0.0) * 100)
        for flag, name in ((False, "off"), (True, "on"))
        if flag in runs
    ]
    ax2.bar(
        [r[0] for r in rates],
        [r[1] for r in rates],
        color=["#7f7f7f", COLORS["paged"]][: len(rates)],
    )
    for i, (_, rate) in enumerate(rates):
        ax2.annotate(
            f"{rate:.1f}%",
            (i, rate),
            textcoords="offset points",
            xytext=(0, 3),
            ha="center",
            fontsize=9,
        )
    ax2.set_ylim(0, 105)
    ax2.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    ax2.set_xlabel("prefix caching")
    ax2.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)
