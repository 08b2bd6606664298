"""Start-up warm-up: every Triton kernel variant a server can launch, listed
from the model's attention layout and compiled before the first request.

A *variant* is what Triton compiles once and caches: one kernel with one
set of constexprs, warps, stages and argument specialisations (ints
divisible by 16, aligned pointers). Which variants a server launches
depends only on its :class:`AttentionLayout` and the GPU; per-step sizes
never change them (``tests/triton/test_compile_matrix.py`` proves that).
So :func:`kernel_variants` plans each launch with the ops' own planning
functions on tiny tensors: ``write_kv``, ``copy_blocks`` (and an int8
cache's scales), and decode (plus the split merge, where a context can be
long enough to split) and prefill once per distinct (window, soft-cap) pair
of the model's layers. :func:`warm_up` launches each once on those tensors
on CUDA, which compiles and loads it; under Triton's CPU interpreter nothing
compiles, so it only lists.

``tests/server/engine/test_kernel_warmup.py`` records every launch of real
engine runs (prefill, decode, chunks, prefix hits, forks) and checks that
the set launched is exactly this list.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from paged_triton.launch import Launch, device_arch, variant_key
from paged_triton.launch_checks import check_quantized_cache


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What one layer passes to the attention ops besides tensors."""

    sliding_window: int | None = None
    softcap: float | None = None


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    """Everything that decides which kernel variants a model launches.
    ``num_heads``/``num_kv_heads``: per rank under tensor parallelism;
    ``dtype``: the model's (queries, new K/V); ``kv_cache_dtype``: what the
    cache stores; ``num_blocks``: the pool's (``copy_blocks`` is
    specialised on its per-layer stride); ``max_model_len`` decides whether
    a decode context can be long enough to split; ``layers``: one entry per
    layer (duplicates are fine); ``static_kv_scales``: the 8-bit cache keeps
    static per-head scales (``calculate_kv_scales``) instead of per-token ones."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    block_size: int
    num_blocks: int
    max_model_len: int
    layers: tuple[LayerAttention, ...]
    static_kv_scales: bool = False


@dataclass(slots=True)
class KernelVariant:
    """One variant: a readable name and the launch that compiles it."""

    name: str
    launch: Launch

    def key(self, arch: int | None = None) -> tuple[Any, ...]:
        """What Triton compiles for it (see :func:`variant_key`)."""
        return variant_key(self.launch, arch)


@dataclass(slots=True)
class Warmup:
    """What :func:`warm_up` did: the variants, and seconds spent compiling
    them (``compiled`` is False under the interpreter: listed only)."""

    variants: list[KernelVariant]
    seconds: float
    compiled: bool


def kernel_variants(
    layout: AttentionLayout,
    device: torch.device,
    *,
    arch: int | None = None,
    policy: Any = None,
) -> list[KernelVariant]:
    """Every variant a server with ``layout`` on ``device`` can launch, each
    once, planned on tiny tensors on ``device``. ``arch``/``policy`` plan
    for another GPU than ``device`` (compute capability, ``SplitPolicy``;
    the compile matrix uses them to compile the list ahead of time)."""
    from paged_triton.decode_splits import split_policy

    arch = arch if arch is not None else device_arch(device)
    planner = _Planner(layout, device, arch, policy or split_policy(device))
    out = [KernelVariant("write_kv", planner.write_kv())]
    out += [KernelVariant(name, launch) for name, launch in planner.copy_blocks()]
    for layer in dict.fromkeys(layout.layers):  # distinct, in layer order
        flags = "".join(
            [" window" if layer.sliding_window else "", " softcap" if layer.softcap else ""]
        )
        decode = planner.decode(layer)
        out.append(KernelVariant("decode" + flags, decode[0]))
        out += [KernelVariant("decode_merge" + flags, merge) for merge in decode[1:]]
        out.append(KernelVariant("prefill" + flags, planner.prefill(layer)))
    return _distinct(out, arch)


def warm_up(layout: AttentionLayout, device: torch.device) -> Warmup:
    """Compile every variant of :func:`kernel_variants` on ``device`` (CUDA)
    by launching it once on tiny tensors; under the interpreter, list them
    only. Returns the variants and the seconds it took."""
    start = time.perf_counter()
    variants = kernel_variants(layout, device)
    compiled = device.type == "cuda"
    if compiled:
        for variant in variants:
            variant.launch.run()
        torch.cuda.synchronize(device)
    return Warmup(variants, time.perf_counter() - start, compiled)


def _distinct(variants: list[KernelVariant], arch: int | None) -> list[KernelVariant]:
    """One per key: layers with different window sizes may share a variant."""
    seen: dict[tuple[Any, ...], KernelVariant] = {}
    for variant in variants:
        seen.setdefault(variant.key(arch), variant)
    return list(seen.values())


class _Planner:
    """The ops' planning functions on tiny tensors shaped like the pool's
    (one token, one sequence; the caches hold two blocks)."""

    def __init__(
        self, layout: AttentionLayout, device: torch.device, arch: int | None, policy: Any
    ) -> None:
        from paged_ref.kv_quant import HEAD_SCALE_DTYPE, new_scales, scale_keywords, storage_shape

        self.layout, self.device, self.arch, self.policy = layout, device, arch, policy
        self.interpret = arch is None  # no GPU to plan for: Triton's interpreter
        lo = layout
        cache_shape = storage_shape((2, lo.block_size, lo.num_kv_heads, lo.head_dim), lo.kv_cache_dtype)
        self.k_cache = self._zeros(*cache_shape, dtype=lo.kv_cache_dtype)
        self.v_cache = self._zeros(*cache_shape, dtype=lo.kv_cache_dtype)
        self.k_scales = new_scales(self.k_cache, lo.static_kv_scales, "k_scales")
        self.v_scales = new_scales(self.v_cache, lo.static_kv_scales, "v_scales")
        head = None
        if lo.static_kv_scales:
            head = torch.ones(lo.num_kv_heads, dtype=HEAD_SCALE_DTYPE, device=device)
        self.scales: dict[str, Any] = scale_keywords(self.k_scales, self.v_scales, head, head)
        # A cache the kernels cannot serve here (fp8 e4m3 before sm_89) fails now, clearly.
        check_quantized_cache(self.k_cache, self.k_scales, self.v_scales, head, head)
        self.q = self._zeros(1, lo.num_heads, lo.head_dim, dtype=lo.dtype)
        self.lens = torch.ones(1, dtype=torch.int32, device=device)

    def _zeros(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def write_kv(self) -> Launch:
        from paged_ref.op_args import WriteKVArgs
        from paged_triton.write_kv import plan_write_kv

        kv = self._zeros(1, self.layout.num_kv_heads, self.layout.head_dim, dtype=self.layout.dtype)
        slots = torch.zeros(1, dtype=torch.int64, device=self.device)
        return plan_write_kv(WriteKVArgs(self.k_cache, self.v_cache, kv, kv, slots, **self.scales), self.interpret)

    def copy_blocks(self) -> list[tuple[str, Launch]]:
        """The caches' copy, and an int8 cache's scales' (same kernel, other
        dtype), over all layers: ``[layers, num_blocks, ...]`` strides as
        the pool has them, over two blocks of memory."""
        from paged_triton.copy_blocks import plan_copy_blocks

        pairs = torch.tensor([[0, 1]], dtype=torch.int64, device=self.device)
        out = []
        v_scales = None  # int4: V's scales have their own shape (another variant)
        if self.v_scales is not None and self.k_scales is not None:
            v_scales = self.v_scales if self.v_scales.shape != self.k_scales.shape else None
        for name, cache in (("copy_blocks", self.k_cache), ("copy_blocks scales", self.k_scales),
                            ("copy_blocks v scales", v_scales)):  # fmt: skip
            if cache is None:
                continue
            caches = self._all_layers(cache)
            out.append((name, plan_copy_blocks(caches, caches, caches, caches, pairs)))
        return out

    def _all_layers(self, cache: torch.Tensor) -> torch.Tensor:
        block = cache[0].numel()
        inner = cache.stride()[1:]
        strides = (self.layout.num_blocks * block, block, *inner)
        return cache.as_strided((1, *cache.shape), strides)

    def decode(self, layer: LayerAttention) -> list[Launch]:
        """The decode launch, and the merge when a context of up to
        ``max_model_len`` tokens (or the window) can be split on this GPU."""
        from paged_triton.decode_attention import plan_decode

        lo = self.layout
        width = -(-lo.max_model_len // lo.block_size)  # the widest block table
        tables = torch.zeros(1, width, dtype=torch.int32, device=self.device)
        return plan_decode(
            self.q, self.k_cache, self.v_cache, tables, self.lens, lo.head_dim**-0.5,
            layer.sliding_window, layer.softcap, torch.empty_like(self.q), self.policy,
            self.arch, self.interpret, **self.scales,
        )  # fmt: skip

    def prefill(self, layer: LayerAttention) -> Launch:
        from paged_triton.prefill_attention import plan_prefill

        tables = torch.zeros(1, 1, dtype=torch.int32, device=self.device)
        cu_q = torch.tensor([0, 1], dtype=torch.int32, device=self.device)
        return plan_prefill(
            self.q, self.k_cache, self.v_cache, tables, cu_q, self.lens,
            self.layout.head_dim**-0.5, layer.sliding_window, layer.softcap,
            torch.zeros_like(self.q), self.arch, self.interpret, **self.scales,
        )  # fmt: skip
