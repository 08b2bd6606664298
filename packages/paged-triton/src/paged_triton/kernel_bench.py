"""Measuring the kernels the way the anchors (vLLM, SGLang) do.

- :func:`kernel_ms`: ``triton.testing.do_bench`` on CUDA (warm-up, then
  repetitions timed with CUDA events, each after flushing the L2 cache by
  writing a buffer larger than it), so a step's K/V come from HBM as in
  serving. Without CUDA a few timed calls (the interpreter: no speed claim).
- :func:`decode_step` / :func:`prefill_step`: a layer's caches holding
  exactly the given contexts in randomly permuted blocks (no locality a
  real pool would not have), and the step's queries and metadata.
- :func:`peak_bandwidth`: the device's HBM bandwidth, to report achieved
  GB/s as a fraction of it.

Shared by ``benchmarks/test_*_attention_bench.py`` and ``nox -s gpu``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

# Peak HBM bandwidth (bytes/s) by device name, where the driver's numbers are missing.
KNOWN_PEAKS = {
    "H200": 4.8e12,
    "H100 SXM": 3.35e12,
    "H100 80GB HBM3": 3.35e12,
    "H100 PCIe": 2.0e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100 80GB PCIe": 1.935e12,
    "A100-SXM4-40GB": 1.555e12,
    "L40S": 0.864e12,
    "RTX 4090": 1.008e12,
    "A10": 0.6e12,
    "L4": 0.3e12,
}


def peak_bandwidth(device: torch.device) -> float | None:
    """Peak memory bandwidth of ``device`` in bytes/s: ``PAGED_PEAK_GBPS`` if
    set, else 2 x memory clock x bus width (double data rate) when the
    driver reports them, else :data:`KNOWN_PEAKS` by name; ``None`` on CPU."""
    if os.environ.get("PAGED_PEAK_GBPS"):
        return float(os.environ["PAGED_PEAK_GBPS"]) * 1e9
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8
    for name, peak in KNOWN_PEAKS.items():
        if name in props.name:
            return peak
    return None


def l2_bytes(device: torch.device) -> int | None:
    """The GPU's L2 cache size (``None`` on CPU or when unknown)."""
    if device.type != "cuda":
        return None
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None)


def kernel_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Mean milliseconds per call of ``fn``: ``do_bench`` with the L2 flushed
    before each timed call on CUDA; elsewhere the mean of 3 calls after one
    warm-up (a smoke number, not a speed)."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100))
    fn()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - start) / 3 * 1e3


@dataclass(slots=True)
class Step:
    """One layer's caches and one step's attention inputs."""

    q: Tensor
    k_cache: Tensor
    v_cache: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    cu_seqlens_q: Tensor | None  # prefill only
    scale: float
    kv_bytes: int  # K and V bytes the step must read (each visible key once per kv head)
    cache_bytes: int  # the caches' size: the working set, compared with L2


def _caches(
    contexts: list[int], kv_heads: int, head_dim: int, block_size: int, dtype, device, gen
) -> tuple[Tensor, Tensor, Tensor, int]:
    blocks = [-(-n // block_size) for n in contexts]
    num_blocks = sum(blocks) + 1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, dtype=torch.float32).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen, dtype=torch.float32).to(device, dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(contexts), max(blocks), dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = perm[used : used + n]
        used += n
    return k_cache, v_cache, tables.to(device), 2 * k_cache.numel() * k_cache.element_size()


def decode_step(contexts: list[int], **layout: Any) -> Step:
    """A decode step: one query per sequence at the end of ``contexts``
    (``layout``: as :func:`prefill_step`'s, Llama 3.2 3B's by default)."""
    step = prefill_step(contexts, [1] * len(contexts), **layout)
    step.cu_seqlens_q = None  # one query each: the decode op's arguments
    return step


def prefill_step(
    contexts: list[int],
    new_tokens: list[int],
    heads: int = 24,
    kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> Step:
    """A prefill step: sequence ``b`` computes its last ``new_tokens[b]`` of
    ``contexts[b]`` tokens (a chunk after a prefix hit when fewer); the
    defaults are Llama 3.2 3B's attention layout."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, tables, cache_bytes = _caches(
        contexts, kv_heads, head_dim, block_size, dtype, device, gen
    )
    cu = torch.zeros(len(contexts) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(new_tokens).cumsum(0)
    q = torch.randn(int(cu[-1]), heads, head_dim, generator=gen).to(device, dtype)
    seq_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    kv_bytes = 2 * sum(contexts) * kv_heads * head_dim * k_cache.element_size()
    return Step(
        q, k_cache, v_cache, tables, seq_lens, cu.to(device), head_dim**-0.5, kv_bytes, cache_bytes
    )


def causal_flops(contexts: list[int], new_tokens: list[int], heads: int, head_dim: int) -> float:
    """Multiply-add FLOPs of a prefill step's attention (QK^T and PV, causal)."""
    # Query i of a sequence whose chunk starts at `first` sees first + i + 1 keys.
    total = sum(q * (n - q) + q * (q + 1) // 2 for n, q in zip(contexts, new_tokens, strict=True))
    return 4.0 * total * heads * head_dim


def noop_kernel(kernel: Any) -> Any:
    """A JIT kernel with ``kernel``'s parameters (and specialisation flags)
    and an empty body, to time what the host spends around a launch: swap it
    in for the real kernel and the GPU time per call is ~nothing."""
    import importlib.util
    import tempfile

    import triton

    constexprs = {p.name for p in kernel.params if p.is_constexpr}
    params = ", ".join(f"{n}: tl.constexpr" if n in constexprs else n for n in kernel.arg_names)
    source = f"import triton.language as tl\n\ndef {kernel.__name__}({params}):\n    pass\n"
    path = Path(tempfile.mkdtemp()) / f"noop_{kernel.__name__}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return triton.jit(
        do_not_specialize=[p.name for p in kernel.params if p.do_not_specialize],
        do_not_specialize_on_alignment=[
            p.name for p in kernel.params if p.do_not_specialize_on_alignment
        ],
    )(getattr(module, kernel.__name__))
