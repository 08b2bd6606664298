"""Kernel-only time of a decode step's projections, per weight format, on CPU.

``python benchmarks/quantized_gemm.py [--rows 1] [--rounds 9] [--threads 1]``
builds the ~100M bench Llama's decoder projections (per layer: the fused
q/k/v, o, the fused gate/up and down, as the model stacks them) with random
weights, in bfloat16 (``nn.Linear``; ``bf16_few_row``: the same weights through
``few_row_gemm`` at 1-8 rows, where it builds) and as the ``QuantizedLinear`` layers
``--quantization int8`` / ``int4`` load, chains them as a layer does (every
output used, so the compiler drops none), and times one pass over all
layers at ``--rows`` tokens: eager, and compiled the way the engine's
one-row graph is (``CompiledForward``: freezing, inductor's C++ GEMM
template). Formats and modes alternate round by round; medians of CPU time.
Reports ms per pass and GB/s of weight bytes read: what a decode step's
GEMMs cost without attention, norms, sampling or Python, i.e. the bound
``quantized_decode``'s ratios approach.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch._inductor.config as inductor_config
from torch import nn

from paged_server.engine.worker.compiled_forward import ONE_ROW_OPTIONS as _COMPILE_OPTIONS
from paged_server.models import few_row_gemm
from paged_server.models.quantization.linear import QuantizedLinear
from paged_server.models.quantization.load import quantize_online

FORMATS = ("bfloat16", "int8", "int4")
FEW_ROW = "bf16_few_row"  # also run, after bfloat16, where few_row_gemm builds
MODES = ("eager", "compiled")


def projection_shapes(cfg: dict[str, Any]) -> list[tuple[int, int]]:
    """One layer's (out, in) features: q/k/v stacked, o, gate/up stacked, down."""
    hidden, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]


class _FewRowLinear(nn.Linear):
    """A bf16 projection as the engine runs it on a CPU with AVX512-BF16:
    1-8 rows through ``few_row_gemm`` (``linear.attach_few_row_weights``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return few_row_gemm.linear(self, x, None)


def _layer(weight: torch.Tensor, fmt: str) -> nn.Module:
    if fmt in ("bfloat16", FEW_ROW):
        linear = (nn.Linear if fmt == "bfloat16" else _FewRowLinear)(weight.shape[1], weight.shape[0], bias=False)
        linear.weight = nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)
        if fmt == FEW_ROW:
            linear.register_buffer("few_row_weight", few_row_gemm.pack(linear.weight), persistent=False)
        return linear
    return QuantizedLinear(quantize_online(weight, fmt), None, torch.device("cpu"))  # as served


class Projections(nn.Module):
    """Every layer's projections, chained as a decoder layer chains them."""

    def __init__(self, cfg: dict[str, Any], fmt: str, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.q_width = cfg["num_attention_heads"] * cfg["head_dim"]
        self.inter = cfg["intermediate_size"]
        self.layers = nn.ModuleList(
            nn.ModuleList(_layer(torch.randn(n, k, generator=gen) * 0.02, fmt) for n, k in projection_shapes(cfg))
            for _ in range(cfg["num_hidden_layers"])
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for qkv, o, gate_up, down in self.layers:  # type: ignore[misc]
            x = x + o(qkv(x)[:, : self.q_width])
            g = gate_up(x)
            x = x + down(g[:, : self.inter] * g[:, self.inter :])
        return x

    def weight_bytes(self) -> int:
        """Bytes a pass reads: a few-row layer's packed copy, not also its weight."""
        read = [
            t for m in self.modules() if not list(m.children())
            for t in ([m.few_row_weight] if hasattr(m, "few_row_weight") else [*m.parameters(), *m.buffers()])
        ]  # fmt: skip
        return sum(t.numel() * t.element_size() for t in read)


def _runner(model: Projections, mode: str, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    if mode == "eager":
        return lambda: model(x)
    compiled = torch.compile(model, fullgraph=True)
    with inductor_config.patch(**_COMPILE_OPTIONS):
        compiled(x)  # compile now, not in the first timed round
    return lambda: compiled(x)


def gemm_table(
    cfg: dict[str, Any], rows: int = 1, rounds: int = 9, formats: tuple[str, ...] = FORMATS,
    modes: tuple[str, ...] = MODES, repeat: int = 3,
) -> list[dict[str, Any]]:  # fmt: skip
    """One row per format and mode: median ms per pass over all layers (CPU
    time), GB/s of weight bytes, and the ratio to bfloat16 in the same mode."""
    x = torch.randn(rows, cfg["hidden_size"], generator=torch.Generator().manual_seed(1)).to(
        torch.bfloat16
    )
    runs: dict[tuple[str, str], Callable[[], torch.Tensor]] = {}
    sizes: dict[str, int] = {}
    with torch.no_grad():
        for fmt in formats:
            model = Projections(cfg, fmt).eval()
            sizes[fmt] = model.weight_bytes()
            for mode in modes:
                runs[(fmt, mode)] = _runner(model, mode, x)
        times: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
        with inductor_config.patch(**_COMPILE_OPTIONS):
            for _ in range(rounds):
                for key, run in runs.items():
                    start = time.process_time()
                    for _ in range(repeat):
                        run()
                    times[key].append((time.process_time() - start) / repeat * 1e3)
    table = []
    for fmt, mode in runs:
        ms = statistics.median(times[(fmt, mode)])
        ref = statistics.median(times[("bfloat16", mode)]) if "bfloat16" in formats else None
        table.append({
            "format": fmt, "mode": mode, "rows": rows, "ms": round(ms, 3),
            "weight_bytes": sizes[fmt], "gb_s": round(sizes[fmt] / ms / 1e6, 2),
            "speedup_vs_bfloat16": None if ref is None else round(ref / ms, 2),
        })  # fmt: skip
    return table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--rows", type=int, default=1, help="tokens per pass (1 = one stream's decode step)"
    )
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--formats", help=f"default: {','.join(FORMATS)}, and {FEW_ROW} where it builds")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from paged_server.bench.model_configs import LLAMA_100M

    default = (FORMATS[0], FEW_ROW, *FORMATS[1:]) if few_row_gemm.available() else FORMATS
    formats = tuple(args.formats.split(",")) if args.formats else default
    table = gemm_table(LLAMA_100M, args.rows, args.rounds, formats, tuple(args.modes.split(",")))
    print(json.dumps({"threads": torch.get_num_threads(), "rows": args.rows}))
    for row in table:
        print(json.dumps(row))
    print(
        f"\n{'format':10} {'mode':9} {'ms/pass':>8} {'GB/s':>6} {'vs bf16':>8} {'weights MB':>10}"
    )
    for r in table:
        print(f"{r['format']:10} {r['mode']:9} {r['ms']:>8} {r['gb_s']:>6} "
              f"{r['speedup_vs_bfloat16']!s:>8} {r['weight_bytes'] / 1e6:>10.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
