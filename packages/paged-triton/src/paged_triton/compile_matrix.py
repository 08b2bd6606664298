"""Compile every kernel variant the supported model families produce, for
real GPUs (sm_80, sm_89, sm_90), on any machine, GPU or not.

A *variant* is one kernel with one set of constexprs, warps and stages. The
variants come from the head layouts of the families ``paged`` serves
(:data:`FAMILIES`) plus a few layouts that keep 1-8 query heads per kv head, soft-capping
and 32-token blocks covered (:data:`COVERAGE`), in fp16 and bf16 (fp32 where
a CPU pool uses it). Each is planned by the ops' own planning functions
(``plan_decode``, ``plan_prefill``, ...) on ``meta`` tensors, then
specialised exactly as Triton's JIT would specialise those arguments on a
GPU (divisibility by 16, ``do_not_specialize``), and compiled ahead of time
with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``
using the ``ptxas`` shipped in the triton wheel.

Each result records registers, stack and local memory per thread
(``cuobjdump -res-usage``; any in a 16-bit kernel are register spills),
shared memory (must fit the target), and for the attention kernels how
many shared-memory buffers the pipeliner gave the K/V tiles.

Used by ``tests/triton/test_compile_matrix.py`` (``nox -s test``; it also
compiles one model's start-up warm-up list, :func:`warmup_jobs`) and the
GPU report (``nox -s gpu``); ``python -m paged_triton.compile_matrix``
prints the table. Compiles run in worker processes with the interpreter
off; Triton's cache (``TRITON_CACHE_DIR``) makes reruns fast.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import TYPE_CHECKING, Any

import torch

from paged_triton.launch import Launch, specialize
from paged_triton.tile_config import smem_limit

if TYPE_CHECKING:
    from paged_triton.warmup import AttentionLayout

ARCHS = (80, 89, 90)
KERNELS = ("write_kv", "decode", "decode_merge", "prefill", "copy_blocks")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# What the cache stores (EngineConfig.kv_cache_dtype); "auto" = the model dtype.
KV_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int4": torch.uint8,  # packed, two codes per byte (paged_ref.kv_int4)
}


@dataclass(frozen=True, slots=True)
class Layout:
    """A model's attention layout: heads, kv heads, head_dim, and the window
    its local layers use (their global layers run without one)."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None = None


FAMILIES = (
    Layout("Llama 3.2 1B", 32, 8, 64),
    Layout("Llama 3.2 3B", 24, 8, 128),
    Layout("Qwen3 0.6B/1.7B", 16, 8, 128),
    Layout("Qwen3 4B/8B", 32, 8, 128),
    Layout("Gemma 3 1B", 4, 1, 256, window=512),
    Layout("Gemma 3 4B", 8, 4, 256, window=1024),
    Layout("Gemma 3 12B", 16, 8, 256, window=1024),
)
# No supported family has these today; they keep the rest of the GQA range covered.
COVERAGE = (
    Layout("MHA d128", 16, 16, 128),
    Layout("GQA-8 d128", 64, 8, 128),
    Layout("MQA-8 d64", 8, 1, 64),
)


@dataclass(frozen=True, slots=True)
class Variant:
    """One launch to compile: a kernel for a layout and the options a layer uses."""

    kernel: str
    layout: Layout
    dtype: str = "bf16"
    block_size: int = 16
    window: bool = False
    softcap: bool = False
    kv_dtype: str = "auto"
    head_scales: bool = False  # static per-head scales (calculate_kv_scales); 8-bit kv_dtype only

    @property
    def label(self) -> str:
        flags = [
            f"bs{self.block_size}",
            *([f"kv={self.kv_dtype}"] if self.kv_dtype != "auto" else []),
            *(["head-scales"] if self.head_scales else []),
            *(["window"] if self.window else []),
            *(["softcap"] if self.softcap else []),
        ]
        layout = self.layout
        shape = f"{layout.heads}/{layout.kv_heads}x{layout.head_dim}"
        return f"{self.kernel} {self.dtype} {shape} {' '.join(flags)} ({layout.name})"


def core_variants() -> list[Variant]:
    """What ``nox -s test`` compiles (about 30 variants per arch): for one
    family per head_dim (64, 128, 256: Llama 3.2 1B, Llama 3.2 3B, Gemma 3
    1B) decode, its split merge, prefill and write_kv in fp16 and bf16;
    Gemma's windowed layers; soft-capping, 32-token blocks and fp32 once
    each; 1 and 8 query heads per kv head; copy_blocks. Family layouts left
    out share these kernels' code paths and differ only in constexpr masks
    (2 and 4 query heads per kv head both pad to 16 decode rows, for instance);
    :func:`exhaustive_variants` compiles them all. Whether a decode step is
    split is decided on the device, so one decode variant serves both."""
    llama_1b, llama_3b, gemma_1b = FAMILIES[0], FAMILIES[1], FAMILIES[4]
    out: list[Variant] = []
    for layout in (llama_1b, llama_3b, gemma_1b):
        for dtype in ("fp16", "bf16"):
            out += [Variant(k, layout, dtype) for k in ("prefill", "decode", "decode_merge")]
            out.append(Variant("write_kv", layout, dtype))
    out += [
        Variant("decode", gemma_1b, "bf16", window=True),
        Variant("prefill", gemma_1b, "bf16", window=True),
        Variant("decode", FAMILIES[5], "bf16", window=True, softcap=True),  # GQA 2 x 256
        Variant("prefill", FAMILIES[5], "bf16", window=True, softcap=True),
        Variant("decode", llama_3b, "bf16", block_size=32),
        Variant("prefill", llama_3b, "bf16", block_size=32),
        Variant("decode", llama_3b, "fp32"),
        Variant("prefill", llama_3b, "fp32"),
    ]
    for layout in COVERAGE[:2]:  # 1 (MHA) and 8 query heads per kv head
        out += [Variant("decode", layout, "bf16"), Variant("prefill", layout, "bf16")]
    out += [Variant("copy_blocks", llama_3b, dtype) for dtype in ("bf16", "fp32")]
    out += quantized_variants()
    return _unique(out)


def quantized_variants() -> list[Variant]:
    """The 8-bit KV caches (``--kv-cache-dtype``): write_kv, decode and
    prefill for each kv dtype with a bf16 model at head_dim 128 (and fp16 at
    head_dim 64 for int8), Gemma's window + soft-cap once, and copy_blocks
    (an int8 cache copies its scales with the same kernel)."""
    llama_1b, llama_3b, gemma_4b = FAMILIES[0], FAMILIES[1], FAMILIES[5]
    out: list[Variant] = []
    for kv in ("int8", "fp8_e4m3", "fp8_e5m2"):
        out += [Variant(k, llama_3b, "bf16", kv_dtype=kv) for k in ("write_kv", "decode", "prefill")]
        out.append(Variant("copy_blocks", llama_3b, "bf16", kv_dtype=kv))
    out += [Variant(k, llama_1b, "fp16", kv_dtype="int8") for k in ("write_kv", "decode", "prefill")]
    out += [
        Variant(k, gemma_4b, "bf16", window=True, softcap=True, kv_dtype="int8")
        for k in ("decode", "prefill")
    ]
    # int4 (KV_QUANT 3 and its own write kernel): head_dim 64, 128 and 256, block sizes
    # 16 and 64 (key groups of 16 and 64 tokens), Gemma's window + soft-cap once.
    gemma_1b = FAMILIES[4]
    out += [Variant(k, llama_1b, "fp16", 64, kv_dtype="int4") for k in ("write_kv", "decode", "prefill")]
    out += [Variant(k, llama_3b, "bf16", kv_dtype="int4") for k in ("write_kv", "decode", "prefill")]
    out += [Variant(k, gemma_1b, "bf16", 64, True, True, "int4") for k in ("decode", "prefill")]
    out += [Variant("write_kv", gemma_1b, "bf16", 64, kv_dtype="int4"),
            Variant("copy_blocks", llama_3b, "bf16", kv_dtype="int4")]  # fmt: skip
    # Static per-head scales (calculate_kv_scales): the HEAD_SCALES constexpr for int8 and fp8.
    for kv in ("int8", "fp8_e4m3"):
        out += [
            Variant(k, llama_3b, "bf16", kv_dtype=kv, head_scales=True)
            for k in ("write_kv", "decode", "prefill")
        ]
    return out


def exhaustive_variants() -> list[Variant]:
    """Every family and coverage layout x fp16/bf16/fp32 x block size 16/32 x
    window x softcap (``PAGED_COMPILE_MATRIX=exhaustive``)."""
    out: list[Variant] = []
    for layout in FAMILIES + COVERAGE:
        for dtype in DTYPES:
            for block_size in (16, 32):
                out.append(Variant("write_kv", layout, dtype, block_size))
                for window in (False, True):
                    for softcap in (False, True):
                        for kernel in ("prefill", "decode"):
                            out.append(Variant(kernel, layout, dtype, block_size, window, softcap))
            out.append(Variant("decode_merge", layout, dtype))
        out += [Variant("copy_blocks", layout, dtype) for dtype in DTYPES]
    return _unique(out)


def unsupported(variant: Variant, arch: int) -> str | None:
    """Why ``variant`` is not compiled for ``arch`` (None: it is). The ops
    refuse the same combinations with a clear error
    (``launch_checks.check_quantized_cache``)."""
    if variant.kv_dtype == "fp8_e4m3" and arch < 89:
        return "Triton has no fp8 e4m3 (fp8e4nv) conversions before sm_89; use fp8_e5m2 or int8"
    return None


def _unique(variants: Iterable[Variant]) -> list[Variant]:
    return list(dict.fromkeys(variants))


# -- planning: the ops' own launch plans on meta tensors ------------------------------


def plan(variant: Variant, arch: int, batch: int = 64, width: int = 256, offset: int = 0) -> Launch:
    """The launch the op would make for ``variant`` on a GPU of ``arch``, in
    a step of ``batch`` sequences whose block tables are ``width`` wide and
    whose metadata tensors start ``offset`` bytes into the step's packed
    buffer (8 is what ``attention_metadata.to_device`` can give)."""
    from paged_ref.kv_int4 import scale_shapes
    from paged_ref.kv_quant import storage_shape
    from paged_ref.op_args import WriteKVArgs
    from paged_triton.copy_blocks import plan_copy_blocks
    from paged_triton.decode_attention import plan_decode
    from paged_triton.decode_splits import SplitPolicy
    from paged_triton.prefill_attention import plan_prefill
    from paged_triton.write_kv import plan_write_kv

    layout, dtype = variant.layout, DTYPES[variant.dtype]
    heads, kv_heads, head_dim = layout.heads, layout.kv_heads, layout.head_dim
    bs = variant.block_size

    def empty(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(*shape, device="meta", dtype=dt)

    def step_tensor(*shape: int, dt: torch.dtype = torch.int32) -> torch.Tensor:
        """Small metadata on the CPU (meta tensors have no address to misalign)."""
        n = math.prod(shape)
        skip = offset // torch.empty((), dtype=dt).element_size()
        return torch.zeros(n + skip, dtype=dt)[skip:].view(shape)

    num_blocks = 4096
    kv_dtype = KV_DTYPES[variant.kv_dtype] or dtype
    cache_shape = storage_shape((num_blocks, bs, kv_heads, head_dim), kv_dtype)
    cache = empty(*cache_shape, dt=kv_dtype)
    scale = None  # int8 only: [num_blocks, block_size, kv_heads] float16
    if kv_dtype == torch.int8 and not variant.head_scales:
        scale = empty(num_blocks, bs, kv_heads, dt=torch.float16)
    head = empty(kv_heads, dt=torch.float32) if variant.head_scales else None  # static scales
    scales: dict[str, Any] = {"k_scales": scale, "v_scales": scale}
    if variant.kv_dtype == "int4":  # K per group of tokens, V per token: two shapes
        k_shape, v_shape = scale_shapes(cache)
        scales = {"k_scales": empty(*k_shape, dt=torch.float16), "v_scales": empty(*v_shape, dt=torch.float16)}
    if head is not None:
        scales = {"k_head_scales": head, "v_head_scales": head}
    window = (layout.window or 1024) if variant.window else None
    softcap = 30.0 if variant.softcap else None
    tables, lens = step_tensor(batch, width), step_tensor(batch)
    if variant.kernel == "write_kv":
        new = empty(batch, kv_heads, head_dim)
        return plan_write_kv(WriteKVArgs(cache, cache, new, new, step_tensor(batch, dt=torch.int64), **scales))
    if variant.kernel == "copy_blocks":
        caches = empty(4, *cache_shape, dt=kv_dtype)
        return plan_copy_blocks(
            caches, caches, caches, caches, step_tensor(batch, 2, dt=torch.int64)
        )
    if variant.kernel == "prefill":
        q = empty(batch * 32, heads, head_dim)
        cu_q = step_tensor(batch + 1)
        return plan_prefill(
            q, cache, cache, tables, cu_q, lens, head_dim**-0.5, window, softcap,
            torch.empty_like(q), arch, interpret=False, **scales,
        )  # fmt: skip
    if variant.kernel in ("decode", "decode_merge"):
        q = empty(batch, heads, head_dim)
        policy = SplitPolicy(target_programs=1 << 16)  # splits whenever the context allows
        launches = plan_decode(
            q, cache, cache, tables, lens, head_dim**-0.5, window, softcap, torch.empty_like(q),
            policy, arch, interpret=False, **scales,
        )  # fmt: skip
        if variant.kernel == "decode":
            return launches[0]
        if len(launches) != 2:
            raise ValueError(f"{variant.label}: {width} blocks of {bs} tokens cannot be split")
        return launches[1]
    raise ValueError(f"unknown kernel {variant.kernel!r}; known: {KERNELS}")


# -- what Triton's JIT would compile ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class CompileJob:
    """Everything ``triton.compile`` needs, picklable for a worker process."""

    label: str
    dtype: str
    kernel: str  # "module:function"
    signature: dict[str, str]
    constexprs: dict[str, Any]
    attrs: dict[tuple[int, ...], list[list[Any]]]
    options: dict[str, int]  # num_warps, num_stages (maxnreg)
    arch: int
    block_n: int | None = None  # K/V tile rows (attention kernels)

    @property
    def num_warps(self) -> int:
        return self.options["num_warps"]

    @property
    def num_stages(self) -> int:
        return self.options["num_stages"]

    @property
    def key(self) -> tuple[Any, ...]:
        return (
            self.kernel,
            tuple(self.signature.items()),
            tuple(sorted((k, repr(v)) for k, v in self.constexprs.items())),
            tuple(sorted(self.attrs)),
            tuple(sorted(self.options.items())),
            self.arch,
        )


def job(variant: Variant, arch: int, **step: int) -> CompileJob:
    """What Triton's JIT would compile for ``variant`` (``step``: see :func:`plan`)."""
    block_n = variant.kernel in ("decode", "prefill")
    return launch_job(variant.label, variant.dtype, plan(variant, arch, **step), arch, block_n)


def launch_job(label: str, dtype: str, launch: Launch, arch: int, block_n: bool) -> CompileJob:
    """What Triton's JIT would compile for ``launch`` on ``arch``; ``dtype``:
    the model's ("fp32" is exempt from the spill check); ``block_n``: an
    attention kernel, whose K/V buffering is checked."""
    signature, constexprs, attrs = specialize(launch, arch)
    fn = launch.kernel
    module = fn.fn.__module__  # the Python function under the JIT or interpreter wrapper
    return CompileJob(
        label=label,
        dtype=dtype,
        kernel=f"{module}:{fn.__name__}",
        signature=signature,
        constexprs=constexprs,
        attrs=attrs,
        options=launch.options,
        arch=arch,
        block_n=launch.constexprs.get("BLOCK_N") if block_n else None,
    )


def warmup_jobs(layout: AttentionLayout, arch: int, sms: int = 132) -> list[CompileJob]:
    """The start-up warm-up's variants (``paged_triton.warmup``) for a model
    of ``layout`` on a GPU of ``arch`` with ``sms`` SMs (which decides
    whether decode splits), as compile jobs."""
    from paged_triton.decode_splits import WAVES_PER_SM, SplitPolicy
    from paged_triton.warmup import kernel_variants

    policy = SplitPolicy(target_programs=WAVES_PER_SM * sms)
    variants = kernel_variants(layout, torch.device("cpu"), arch=arch, policy=policy)
    dtype = next(name for name, dt in DTYPES.items() if dt == layout.dtype)
    attention = ("_decode_kernel", "_prefill_kernel")
    return [
        launch_job(f"warm-up: {v.name}", dtype, v.launch, arch, v.launch.kernel.__name__ in attention)
        for v in variants
    ]


# Each 8-bit cache with per-token scales and with static per-head scales (calculate_kv_scales).
KV_CACHES: tuple[tuple[str, bool], ...] = (("auto", False),) + tuple(
    (kv, static) for kv in ("int8", "fp8_e4m3", "fp8_e5m2") for static in (False, True)
)


def derived_layouts(
    dtypes: Sequence[str] = ("bf16", "fp16"),
    kv_caches: Sequence[tuple[str, bool]] = KV_CACHES,
    layouts: Sequence[Any] | None = None,
) -> list[tuple[str, AttentionLayout]]:
    """(name, one rank's ``AttentionLayout``) for every published layout of
    every supported family (``published_layouts.PUBLISHED``) x each
    tensor-parallel split x model dtype x KV cache."""
    from paged_triton.published_layouts import PUBLISHED
    from paged_triton.warmup import AttentionLayout

    out = []
    for published in layouts or PUBLISHED:
        for tp in published.tp_sizes():
            heads, kv_heads = published.per_rank(tp)
            for dtype in dtypes:
                for kv, static in kv_caches:
                    layout = AttentionLayout(
                        heads, kv_heads, published.head_dim, DTYPES[dtype],
                        KV_DTYPES[kv] or DTYPES[dtype], 16, 4096, published.max_model_len,
                        published.layers, static_kv_scales=static,
                    )  # fmt: skip
                    name = f"{published.name} tp{tp} {dtype} kv={kv}{' static' if static else ''}"
                    out.append((name, layout))
    return out


def derived_jobs(
    archs: Sequence[int] = ARCHS,
    dtypes: Sequence[str] = ("bf16", "fp16"),
    kv_caches: Sequence[tuple[str, bool]] = KV_CACHES,
    layouts: Sequence[Any] | None = None,
) -> list[CompileJob]:
    """The start-up warm-up list (:func:`warmup_jobs`) of every
    :func:`derived_layouts` entry on every arch: what a server compiles on
    start-up, for every configuration a user can choose. Deduplicated
    (layouts that share a per-rank shape share kernels; the label names the
    first); combinations the ops refuse (fp8 e4m3 before sm_89) are left out."""
    jobs: dict[tuple[Any, ...], CompileJob] = {}
    if layouts is None:  # every family: the experts' kernel, the quantized GEMM, LoRA too
        jobs.update((job.key, job) for job in moe_jobs(archs, dtypes))
        jobs.update((job.key, job) for job in quant_matmul_jobs(archs, dtypes))
        jobs.update((job.key, job) for job in lora_jobs(archs, dtypes))
        jobs.update((job.key, job) for job in layer_jobs(archs, dtypes))
    for name, layout in derived_layouts(dtypes, kv_caches, layouts):
        for arch in archs:
            if layout.kv_cache_dtype == torch.float8_e4m3fn and arch < 89:
                continue  # refused by the ops (unsupported())
            for job in warmup_jobs(layout, arch):
                label = f"{name}: {job.label.removeprefix('warm-up: ')}"
                jobs.setdefault(job.key, CompileJob(label, *_fields(job)[1:]))
    return list(jobs.values())


def moe_jobs(
    archs: Sequence[int] = ARCHS, dtypes: Sequence[str] = ("bf16", "fp16")
) -> list[CompileJob]:
    """The fused-MoE GEMMs (``fused_moe.plan_expert_gemm``: gate/up over
    token rows, down over pair rows with the routing weight) for each
    published mixture of experts per tensor-parallel split (each rank holds
    ``1/tp`` of every expert's features), deduplicated."""
    from paged_triton.fused_moe import plan_expert_gemm
    from paged_triton.published_layouts import MOE

    jobs: dict[tuple[Any, ...], CompileJob] = {}
    for moe in MOE:
        for tp in (1, 2, 4, 8):
            inter = moe.intermediate // tp
            tokens, pairs = 64, 64 * moe.top_k
            for dtype in dtypes:
                dt = DTYPES[dtype]

                def meta(*shape: int, dt: torch.dtype = dt) -> torch.Tensor:
                    return torch.empty(*shape, device="meta", dtype=dt)

                sorted_ids = torch.zeros(pairs + moe.experts * 16, dtype=torch.int32)
                blocks = torch.zeros(sorted_ids.numel() // 16, dtype=torch.int32)
                weights = torch.zeros(pairs, dtype=torch.float32)
                launches = {
                    "gate_up": plan_expert_gemm(
                        meta(tokens, moe.hidden), meta(moe.experts, 2 * inter, moe.hidden),
                        meta(pairs, 2 * inter), sorted_ids, blocks, None, moe.top_k, False,
                    ),
                    "down": plan_expert_gemm(
                        meta(pairs, inter), meta(moe.experts, moe.hidden, inter),
                        meta(pairs, moe.hidden), sorted_ids, blocks, weights, moe.top_k, True,
                    ),
                }  # fmt: skip
                for what, launch in launches.items():
                    for arch in archs:
                        label = f"{moe.name} tp{tp} {dtype}: fused_moe {what}"
                        job = launch_job(label, dtype, launch, arch, block_n=False)
                        jobs.setdefault(job.key, job)
    return list(jobs.values())


# (name, hidden, intermediate, heads, kv_heads, head_dim, Gemma's unit-offset norms, q/k norms):
# the layer kernels' variants depend on these sizes and flags only, never on the batch.
LAYER_SHAPES = (
    ("Llama 3.1 8B", 4096, 14336, 32, 8, 128, False, False),
    ("Llama 3.2 1B", 2048, 8192, 32, 8, 64, False, False),
    ("Qwen3 8B", 4096, 12288, 32, 8, 128, False, True),
    ("Gemma 3 1B", 1152, 6912, 4, 1, 256, True, True),
    ("Gemma 3 4B", 2560, 10240, 8, 4, 256, True, True),
)


def layer_jobs(
    archs: Sequence[int] = ARCHS, dtypes: Sequence[str] = ("bf16", "fp16")
) -> list[CompileJob]:
    """The fused layer kernels (``layer_ops``: RMSNorm with and without the
    residual add, per-head q/k norms, RoPE, SiLU-mul) for each model of
    :data:`LAYER_SHAPES`, deduplicated."""
    from paged_triton.layer_ops import plan_rms_norm, plan_rope, plan_silu_mul

    jobs: dict[tuple[Any, ...], CompileJob] = {}
    tokens = 64
    for name, hidden, inter, heads, kv_heads, d, unit, qk_norm in LAYER_SHAPES:
        for dtype in dtypes:
            dt = DTYPES[dtype]

            def meta(*shape: int, dt: torch.dtype = dt) -> torch.Tensor:
                return torch.empty(*shape, device="meta", dtype=dt)

            x, w = meta(tokens, hidden), meta(hidden)
            qkv = meta(tokens, (heads + 2 * kv_heads) * d)
            q = qkv[:, : heads * d].unflatten(-1, (heads, d))
            k = qkv[:, heads * d : (heads + kv_heads) * d].unflatten(-1, (kv_heads, d))
            launches = {
                "rms_norm": plan_rms_norm(x, None, w, 1e-6, unit, x, None),
                "add_rms_norm": plan_rms_norm(x, x, w, 1e-6, unit, x, meta(tokens, hidden)),
                "rope": plan_rope(q, k, meta(tokens, d), meta(tokens, d)),
            }
            if not unit:  # Gemma's MLP is GeGLU, which stays eager
                launches["silu_mul"] = plan_silu_mul(meta(tokens, 2 * inter), meta(tokens, inter))
            if qk_norm:
                launches["qk_norm"] = plan_rms_norm(q, None, meta(d), 1e-6, unit, meta(tokens, heads, d), None)
            for what, launch in launches.items():
                for arch in archs:
                    job = launch_job(f"{name} {dtype}: {what}", dtype, launch, arch, block_n=False)
                    jobs.setdefault(job.key, job)
    return list(jobs.values())


# Llama 3.1 8B's projections at TP 1 as LoRA sees them: (stacked output widths, in).
LORA_SHAPES = {"qkv": ((4096, 1024, 1024), 4096), "o": ((4096,), 4096),
               "gate_up": ((14336, 14336), 4096), "down": ((4096,), 14336)}  # fmt: skip
LORA_RANKS = (8, 16, 64)  # max_lora_rank: 8 is the one not a multiple of 16
# (decode rows, prompt run lengths): decode alone (one row: split-K), mixed, prompts alone.
LORA_STEPS = ((1, ()), (48, (300, 17)), (0, (2048,)))


def lora_jobs(
    archs: Sequence[int] = ARCHS, dtypes: Sequence[str] = ("bf16", "fp16")
) -> list[CompileJob]:
    """The LoRA shrink/expand kernels (``lora_ops.plan_lora``: BGMV for
    decode rows, SGMV for prompt runs) for each projection of
    :data:`LORA_SHAPES` x rank x step in :data:`LORA_STEPS`, 4 slots,
    deduplicated: their tiles are fixed, so shapes and steps share variants."""
    from paged_ref.lora_ops import LoRAMapping
    from paged_triton.lora_ops import plan_lora, split_k

    jobs: dict[tuple[Any, ...], CompileJob] = {}
    for dtype in dtypes:
        dt = DTYPES[dtype]
        for what, (sizes, k) in LORA_SHAPES.items():
            for rank in LORA_RANKS:
                n = len(sizes) * rank
                for decodes, runs in LORA_STEPS:
                    lens = [1] * decodes + list(runs)
                    mapping = LoRAMapping.build(lens, [i % 4 for i in range(len(lens))])
                    rows = sum(lens)

                    def meta(*shape: int, dt: torch.dtype = dt) -> torch.Tensor:
                        return torch.empty(*shape, device="meta", dtype=dt)

                    split = split_k(decodes, n, k) if decodes else 1
                    partial = meta(split, decodes, n, dt=torch.float32) if split > 1 else None
                    launches = plan_lora(
                        meta(rows, k), meta(rows, sum(sizes)), meta(4, n, k),
                        meta(sum(sizes), 4, rank), sizes, mapping,
                        meta(rows, n, dt=torch.float32), partial,
                    )  # fmt: skip
                    for launch in launches:
                        for arch in archs:
                            name = launch.kernel.__name__.strip("_").removesuffix("_kernel")
                            label = f"lora {name} {dtype} ({what}, r{rank})"
                            job = launch_job(label, dtype, launch, arch, block_n=False)
                            jobs.setdefault(job.key, job)
    return list(jobs.values())


# Llama 3.1 8B's projections (N, K) at TP 1: what a quantized checkpoint multiplies by.
QUANT_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                "down": (4096, 14336)}  # fmt: skip
# (name, bits, group size (None: per output channel), zero points): the checkpoint formats.
QUANT_FORMATS = (
    ("int8 per-channel", 8, None, False),  # W8A16, online int8
    ("int8 g128 asym", 8, 128, True),
    ("int4 g128", 4, 128, False),  # W4A16 sym, GPTQ, online int4
    ("int4 g128 asym", 4, 128, True),  # W4A16 asym, AWQ
)
# One M per tile bucket: decode, small batch, and the largest the kernel runs
# (from quant_matmul.DENSE_ROWS rows on the layer dequantizes instead).
QUANT_ROWS = (1, 48, 255)


def quant_matmul_jobs(
    archs: Sequence[int] = ARCHS, dtypes: Sequence[str] = ("bf16", "fp16"), sms: int = 132
) -> list[CompileJob]:
    """The weight-only quantized GEMM (``quant_matmul.plan_quant_matmul``)
    for each format in :data:`QUANT_FORMATS` x M bucket x
    :data:`QUANT_SHAPES` (with and without split-K, as a GPU of ``sms``
    SMs decides), and the one-pass dequantize the layer runs instead from
    ``DENSE_ROWS`` rows (``quant_dequantize.plan_dequantize``), deduplicated:
    shapes that share a variant share a job."""
    from paged_triton.quant_dequantize import plan_dequantize
    from paged_triton.quant_matmul import (
        DENSE_ROWS,
        QuantWeight,
        plan_quant_matmul,
        split_k,
        tile_for,
    )

    assert max(QUANT_ROWS) < DENSE_ROWS, "QUANT_ROWS should stay on the kernel's path"
    jobs: dict[tuple[Any, ...], CompileJob] = {}
    for name, bits, group, asym in QUANT_FORMATS:
        for dtype in dtypes:
            dt = DTYPES[dtype]
            for n, k in QUANT_SHAPES.values():
                g = group or k
                code = torch.int8 if bits == 8 else torch.uint8
                dense = plan_dequantize(
                    QuantWeight(
                        torch.empty(n, k * bits // 8, device="meta", dtype=code),
                        torch.empty(n, k // g, device="meta", dtype=torch.float32),
                        torch.empty(n, k // g, device="meta", dtype=torch.int8) if asym else None,
                        bits, g,
                    ),
                    torch.empty(n, k, device="meta", dtype=dt),
                )  # fmt: skip
                label = f"quant_dequantize {name} {dtype}"
                for arch in archs:
                    job = launch_job(label, dtype, dense, arch, block_n=False)
                    jobs.setdefault(job.key, job)
            for m in QUANT_ROWS:
                for (n, k) in QUANT_SHAPES.values():
                    g = group or k
                    tile = tile_for(m, g, k)
                    splits = split_k(tile, m, n, k, sms)

                    def meta(*shape: int, dt: torch.dtype) -> torch.Tensor:
                        return torch.empty(*shape, device="meta", dtype=dt)

                    packed = meta(n, k * bits // 8, dt=torch.int8 if bits == 8 else torch.uint8)
                    scales = meta(n, k // g, dt=torch.float32)
                    zeros = meta(n, k // g, dt=torch.int8) if asym else None
                    out = meta(m, n, dt=dt) if splits == 1 else meta(splits, m, n, dt=torch.float32)
                    weight = QuantWeight(packed, scales, zeros, bits, g)
                    launch = plan_quant_matmul(meta(m, k, dt=dt), weight, out, splits, tile)
                    split = f" split-K {splits}" if splits > 1 else ""
                    for arch in archs:
                        label = f"quant_matmul {name} {dtype} M<={tile.block_m}{split}"
                        job = launch_job(label, dtype, launch, arch, block_n=False)
                        jobs.setdefault(job.key, job)
    return list(jobs.values())


def _fields(job: CompileJob) -> tuple[Any, ...]:
    return tuple(getattr(job, f) for f in CompileJob.__dataclass_fields__)


# -- compiling (worker side) ------------------------------------------------------------


@dataclass(slots=True)
class CompileResult:
    job: CompileJob
    registers: int = 0
    stack: int = 0  # bytes per thread
    local: int = 0  # bytes per thread
    shared: int = 0  # bytes per block
    kv_buffers: int | None = None  # shared-memory buffers of the K/V tiles
    seconds: float = 0.0
    error: str | None = None
    problems: list[str] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {
            "variant": self.job.label,
            "arch": f"sm_{self.job.arch}",
            "num_warps": self.job.num_warps,
            "num_stages": self.job.num_stages,
            "registers": self.registers,
            "stack": self.stack,
            "local": self.local,
            "shared": self.shared,
            "kv_buffers": self.kv_buffers,
            "seconds": round(self.seconds, 2),
            "error": self.error,
            "problems": self.problems,
        }


def tools_missing() -> str | None:
    """Why AOT compilation cannot run here (``None`` when it can)."""
    try:
        import triton
    except ImportError:
        return "triton is not installed"
    for tool in ("ptxas", "cuobjdump"):
        try:
            getattr(triton.knobs.nvidia, tool)
        except RuntimeError:
            return f"{tool} not found (shipped in triton's wheel under backends/nvidia/bin)"
    return None


def _worker_init() -> None:
    # The kernels must be JITFunctions here, not interpreter stand-ins.
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, stated


_RES_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)")


def compile_job(job: CompileJob) -> CompileResult:
    """Compile ``job`` for its GPU and read its resource usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    result = CompileResult(job)
    module, name = job.kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    start = time.perf_counter()
    try:
        compiled = triton.compile(
            ASTSource(fn, job.signature, job.constexprs, job.attrs),
            target=GPUTarget("cuda", job.arch, 32),
            options=job.options,
        )
    except Exception as exc:  # a compile failure is a result, reported per variant
        result.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
        return result
    result.seconds = time.perf_counter() - start
    result.shared = int(compiled.metadata.shared)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [triton.knobs.nvidia.cuobjdump.path, "-res-usage", f.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    match = _RES_USAGE.search(usage)
    if match is None:
        result.error = f"cannot read cuobjdump -res-usage output: {usage[:200]!r}"
        return result
    result.registers, result.stack, result.local = map(int, match.groups())
    if job.block_n is not None:
        result.kv_buffers = _kv_buffers(compiled.asm["ttgir"], job)
    return result


def _kv_buffers(ttgir: str, job: CompileJob) -> int:
    """Shared-memory buffers the pipeliner allocated for the K/V tiles:
    ``local_alloc`` of ``[buffers x BLOCK_N x BLOCK_D]`` (0 when K/V never
    go through shared memory)."""
    block_d = job.constexprs["BLOCK_D"]
    found = re.findall(rf"memdesc<(\d+)x{job.block_n}x{block_d}x", ttgir)
    return max((int(n) for n in found), default=0)


# -- checking and running -----------------------------------------------------------------


def check(result: CompileResult) -> list[str]:
    """What is wrong with a compiled variant (empty when nothing is)."""
    job = result.job
    if result.error:
        return [f"does not compile: {result.error}"]
    problems = []
    limit = smem_limit(job.arch)
    if result.shared > limit:
        problems.append(f"needs {result.shared} B shared memory, sm_{job.arch} has {limit}")
    if job.dtype != "fp32" and (result.stack or result.local):
        problems.append(
            f"spills: {result.stack} B stack + {result.local} B local per thread "
            f"({result.registers} registers, {job.num_warps} warps)"
        )
    if job.dtype != "fp32" and result.kv_buffers is not None and result.kv_buffers < 2:
        problems.append(f"K/V tiles single-buffered ({result.kv_buffers} buffer)")
    return problems


def run(
    variants: Sequence[Variant], archs: Sequence[int] = ARCHS, workers: int | None = None
) -> list[CompileResult]:
    """Compile every variant for every arch (deduplicated: families that share
    a head layout share compiled kernels) in ``workers`` processes; each
    result carries its :func:`check` problems."""
    pairs = [(v, arch) for arch in archs for v in variants if unsupported(v, arch) is None]
    return run_jobs([job(v, arch) for v, arch in pairs], workers)


def run_jobs(jobs: Sequence[CompileJob], workers: int | None = None) -> list[CompileResult]:
    """Compile ``jobs`` (deduplicated) in ``workers`` processes, each result
    with its :func:`check` problems."""
    unique = list({j.key: j for j in jobs}.values())
    workers = workers or min(len(unique), os.cpu_count() or 1)
    # Always in fresh processes: kernels imported here may be interpreter stand-ins.
    with ProcessPoolExecutor(workers, get_context("spawn"), initializer=_worker_init) as pool:
        results = list(pool.map(compile_job, unique, chunksize=1))
    for result in results:
        result.problems = check(result)
    return results


def markdown(results: Sequence[CompileResult]) -> str:
    """One table row per compiled variant."""
    lines = [
        "| variant | arch | warps | stages | regs | stack | local | shared KB | K/V buffers | problems |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in sorted(results, key=lambda r: (r.job.label, r.job.arch)):
        j = r.job
        lines.append(
            f"| {j.label} | sm_{j.arch} | {j.num_warps} | {j.num_stages} | {r.registers} | "
            f"{r.stack} | {r.local} | {r.shared / 1024:.1f} | "
            f"{'' if r.kv_buffers is None else r.kv_buffers} | {'; '.join(r.problems)} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] = ()) -> int:
    """``python -m paged_triton.compile_matrix [--exhaustive | --derived]``: print the table."""
    missing = tools_missing()
    if missing:
        print(f"compile matrix skipped: {missing}")
        return 0
    start = time.perf_counter()
    if "--derived" in argv:
        results = run_jobs(derived_jobs())
        what = "every published layout's warm-up list x TP x dtype x KV cache x arch"
    else:
        variants = exhaustive_variants() if "--exhaustive" in argv else core_variants()
        results = run(variants)
        what = f"{len(variants)} variants x {len(ARCHS)} archs"
    print(markdown(results))
    bad = [r for r in results if r.problems]
    print(
        f"\n{len(results)} compiles ({what}, deduplicated) "
        f"in {time.perf_counter() - start:.0f} s; {len(bad)} with problems"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
