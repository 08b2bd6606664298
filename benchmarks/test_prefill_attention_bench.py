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
import time
from collections.abc import Callable

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


def test_prefill_and_mixed_host_overhead(benchmark, monkeypatch, request):
    """Host microseconds per layer of a prefill step and of a mixed step
    (write_kv, decode and prefill ops), the first layer (checks, plans)
    against the later ones (the step memo's replay): 32 layers sharing one
    memo, as a forward does. Launches are no-op kernels on CUDA, stubbed on CPU."""
    from paged_triton import decode_attention, prefill_attention, write_kv
    from paged_triton.launch import Launch
    from paged_triton.ops import paged_decode_attention
    from paged_triton.ops import write_kv as write_op

    if CUDA:
        for module, name in ((prefill_attention, "_prefill_kernel"),
                             (decode_attention, "_decode_kernel"), (write_kv, "_write_kv_kernel")):  # fmt: skip
            monkeypatch.setattr(module, name, kernel_bench.noop_kernel(getattr(module, name)))
    else:
        monkeypatch.setattr(Launch, "run", lambda self, args=None: None)
        # One thread: the output's zero-fill is the device's memset on a GPU, and on a
        # shared CPU torch's thread pool makes it milliseconds of waiting.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        request.addfinalizer(lambda: torch.set_num_threads(threads))
    shape = dict(LAYOUT, dtype=torch.bfloat16) if CUDA else dict(CPU_LAYOUT, dtype=torch.float32)
    pre = kernel_bench.prefill_step([512] * 4, [512] * 4, **shape, device=DEVICE)
    dec = kernel_bench.decode_step([1024] * 32, **shape, device=DEVICE)
    kv = torch.randn(pre.q.shape[0], shape["kv_heads"], shape["head_dim"], device=DEVICE)
    slots = torch.arange(pre.q.shape[0], device=DEVICE)

    def prefill(memo: dict) -> None:
        paged_prefill_attention(pre.q, pre.k_cache, pre.v_cache, pre.block_tables,
                                pre.cu_seqlens_q, pre.seq_lens, pre.scale, memo=memo)  # fmt: skip

    def mixed(memo: dict) -> None:
        write_op(pre.k_cache, pre.v_cache, kv.to(pre.k_cache.dtype), kv.to(pre.k_cache.dtype), slots)
        paged_decode_attention(dec.q, dec.k_cache, dec.v_cache, dec.block_tables, dec.seq_lens,
                               dec.scale, memo=memo)  # fmt: skip
        prefill(memo)

    def layers_us(layer: Callable, count: int = 32) -> tuple[float, float]:
        memo: dict = {}
        times = []
        for _ in range(count):
            start = time.perf_counter()
            layer(memo)
            times.append(time.perf_counter() - start)
        if CUDA:
            torch.cuda.synchronize()
        return times[0] * 1e6, sorted(times[1:])[len(times) // 2] * 1e6

    out = {}
    for name, layer in (("prefill", prefill), ("mixed", mixed)):
        layers_us(layer)  # compile, fill the caches
        runs = [layers_us(layer) for _ in range(5)]
        out[f"{name}_first_layer_us"] = min(r[0] for r in runs)
        out[f"{name}_later_layer_us"] = min(r[1] for r in runs)
    benchmark.group = "prefill host overhead"
    benchmark.extra_info.update(out, device=str(DEVICE), measures=(
        "no-op kernels (wrapper + Triton launch)" if CUDA else "launch stubbed: the Python wrappers alone"))  # fmt: skip
    benchmark.pedantic(lambda: layers_us(mixed), rounds=3)
