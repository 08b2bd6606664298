"""Paged prefill attention, measured like the decode benchmark (see
test_decode_attention_bench.py): one layer of Llama 3.2 3B's attention in
bf16, randomly permuted blocks, ``triton.testing.do_bench`` with the L2
flushed on CUDA. ``extra_info``: ``kernel_ms``, attention ``TFLOPs``
(causal QK^T + PV), and the K/V bytes with ``kv_GBps``/``pct_of_peak``
(prefill is compute-bound, so the bandwidth share is low by design).

Cases:
- ``prompts-8x2k``: eight whole 2,048-token prompts;
- ``chunks-4x512-after-8k``: 512-token chunks after 8,192 cached tokens
  (chunked prefill / prefix-cache hits: long context, few queries);
- ``mixed-1x4k+15x256``: one long prompt with short ones (ragged);
- ``impl=dense-sdpa`` (CUDA): torch SDPA (causal) on the first case's
  tensors stored densely, the anchor.

Without CUDA the cases run tiny in Triton's interpreter (not a speed).

Run: ``pytest benchmarks/test_prefill_attention_bench.py --benchmark-only -p no:randomly``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before paged_triton.ops is imported

from paged_triton import kernel_bench  # noqa: E402
from paged_triton.ops import paged_prefill_attention  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
CPU_NOTE = "no CUDA: tiny shapes in Triton's CPU interpreter; not a performance number"
# name -> (contexts, new tokens) on CUDA, and the interpreter's tiny stand-in.
CASES = {
    "prompts-8x2k": (([2048] * 8, [2048] * 8), ([32] * 2, [32] * 2)),
    "chunks-4x512-after-8k": (([8704] * 4, [512] * 4), ([80] * 2, [16] * 2)),
    "mixed-1x4k+15x256": (([4096] + [256] * 15, [4096] + [256] * 15), ([64, 8, 8], [64, 8, 8])),
}
LAYOUT = dict(heads=24, kv_heads=8, head_dim=128, block_size=16)
CPU_LAYOUT = dict(heads=4, kv_heads=2, head_dim=32, block_size=16)


def make_step(name: str) -> tuple[kernel_bench.Step, list[int], list[int], dict]:
    (contexts, new), (cpu_contexts, cpu_new) = CASES[name]
    if CUDA:
        step = kernel_bench.prefill_step(contexts, new, **LAYOUT, device=DEVICE)
        return step, contexts, new, LAYOUT
    step = kernel_bench.prefill_step(
        cpu_contexts, cpu_new, **CPU_LAYOUT, dtype=torch.float32, device=DEVICE
    )
    return step, cpu_contexts, cpu_new, CPU_LAYOUT


def record(benchmark, name, step, contexts, new, layout, ms, impl="triton") -> None:
    flops = kernel_bench.causal_flops(contexts, new, layout["heads"], layout["head_dim"])
    peak = kernel_bench.peak_bandwidth(DEVICE)
    gbps = step.kv_bytes / (ms * 1e-3) / 1e9
    benchmark.extra_info.update(
        case=name,
        impl=impl,
        device=torch.cuda.get_device_name(DEVICE) if CUDA else "cpu (interpreter)",
        dtype=str(step.k_cache.dtype),
        queries=sum(new),
        kernel_ms=ms,
        TFLOPs=flops / (ms * 1e-3) / 1e12,
        kv_bytes=step.kv_bytes,
        working_set_bytes=step.cache_bytes,
        kv_GBps=gbps,
        pct_of_peak=None if peak is None else 100 * gbps * 1e9 / peak,
        timing="do_bench, L2 flushed" if CUDA else CPU_NOTE,
    )


def run_timed(benchmark, fn) -> None:
    def call() -> None:
        fn()
        if CUDA:
            torch.cuda.synchronize()

    benchmark.pedantic(call, rounds=10 if CUDA else 1, warmup_rounds=1 if CUDA else 0)


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_attention(benchmark, name):
    step, contexts, new, layout = make_step(name)

    def fn() -> torch.Tensor:
        return paged_prefill_attention(
            step.q, step.k_cache, step.v_cache, step.block_tables, step.cu_seqlens_q,
            step.seq_lens, step.scale,
        )  # fmt: skip

    assert torch.isfinite(fn()).all()
    benchmark.group = "prefill attention"
    record(benchmark, name, step, contexts, new, layout, kernel_bench.kernel_ms(fn, DEVICE))
    run_timed(benchmark, fn)


@pytest.mark.skipif(not CUDA, reason="dense SDPA anchor: only meaningful on a GPU")
def test_dense_sdpa_anchor(benchmark):
    """Causal torch SDPA over the prompts-8x2k tensors stored densely."""
    step, contexts, new, layout = make_step("prompts-8x2k")
    batch, length = len(contexts), contexts[0]
    q = step.q.view(batch, length, layout["heads"], -1).transpose(1, 2)
    k = torch.randn(batch, layout["kv_heads"], length, layout["head_dim"], device=DEVICE)
    k, v = k.to(q.dtype), torch.randn_like(k).to(q.dtype)

    def fn() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=step.scale, enable_gqa=True
        )

    benchmark.group = "prefill attention"
    record(
        benchmark,
        "dense-sdpa-8x2k",
        step,
        contexts,
        new,
        layout,
        kernel_bench.kernel_ms(fn, DEVICE),
    )
    run_timed(benchmark, fn)
