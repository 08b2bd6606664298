"""Decode attention read in place from the paged cache, as a C loop nest for a CPU.

The reference decode (``ops.paged_decode_attention``) copies every
sequence's K/V out of its blocks before SDPA (PyTorch has no product that
reads through a page table), and on a CPU that copy dominated a decode step.
``cpu_decode.c`` is the same attention as one loop nest per sequence (online
softmax over its blocks, as the Triton decode kernel does), reading K/V in
place. Its measurements are in docs/cpu.md ("The compiled forward pass (CPU)").

It is built on first use (``c_library``), once per head size, query heads
per kv head, kv head count and cache dtype, into ``~/.cache/paged/cpu_decode``.
``ops.paged_decode_attention`` stays the definition; the tests compare the
two on random page tables.

``CpuDecodeOps`` is the ops module a CPU server runs: these kernels for
decodes (and for short prompt chunks, a row at a time), and
``prefill_by_sequence`` (one SDPA call per sequence over its own blocks, in
a 16-bit model's dtype) for the rest of a prefill.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from types import ModuleType
from typing import Any, NamedTuple

import torch
from torch import Tensor

from paged_ref import ops as ref_ops
from paged_ref.attention import context_mask
from paged_ref.cpu import c_library
from paged_ref.op_args import DecodeArgs, PrefillArgs, WriteKVArgs, op

SOURCE = c_library.source("cpu_decode.c")
# The C element types of cache_t and act_t (the cache's and the activations'); uint16_t holds bf16 bits.
_C_TYPES = {torch.bfloat16: "uint16_t", torch.float16: "_Float16", torch.float32: "float"}
# Unscaled fp8 caches (vLLM's "fp8" with its uncalibrated scale of 1.0), held as uint8_t codes.
_FP8_CACHES = {torch.float8_e4m3fn: "E4M3", torch.float8_e5m2: "E5M2"}
MAX_BLOCK = 256  # cpu_decode.c's: the largest block_size the decode kernel takes
# Beside c_library.FLAGS. GCC's x86 default is 256-bit vectors even where the
# CPU has AVX-512, and 512-bit ones made the decode kernel faster (docs/cpu.md).
_FLAGS = ("-ffast-math", "-fno-finite-math-only") + (
    ("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ()
)


class _Kernels(NamedTuple):
    decode: Any  # cpu_decode.c's paged_decode
    write: Any  # and paged_write (None for an int8 cache)


@functools.cache
def _library(head_dim: int, q_per_kv: int, kv_heads: int, cache: torch.dtype, act: torch.dtype) -> _Kernels | None:
    """The built kernels for one layout, or None when they cannot be built."""
    fp8 = _FP8_CACHES.get(cache)
    if fp8:
        cache_type: tuple[str, ...] = ("-Dcache_t=uint8_t", f"-DCACHE_FP8_{fp8}")
    elif cache == torch.int8:
        cache_type = ("-Dcache_t=int8_t", "-DCACHE_INT8")
    else:
        cache_type = (f"-Dcache_t={_C_TYPES[cache]}",)
    defines = (
        f"-DHEAD_DIM={head_dim}", f"-DQ_PER_KV={q_per_kv}", f"-DKV_HEADS={kv_heads}",
        *cache_type, f"-Dact_t={_C_TYPES[act]}",
    )  # fmt: skip
    name = f"decode-d{head_dim}-q{q_per_kv}-kv{kv_heads}-{str(cache)[6:]}-{str(act)[6:]}"
    lib = c_library.build(SOURCE, (*_FLAGS, *defines), "cpu_decode", name)
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    decode = lib.paged_decode
    decode.argtypes = [p] * 6 + [i64] * 5 + [ctypes.c_float, i64, ctypes.c_float, ctypes.c_int, p, p]
    decode.restype = ctypes.c_int
    if cache == torch.int8:  # written by the reference (its scales too)
        return _Kernels(decode, None)
    write = lib.paged_write
    write.argtypes = [p, p, i64, i64, p, i64, p, p, i64]
    write.restype = ctypes.c_int
    return _Kernels(decode, write)


def _kernels(x: Tensor, cache: Tensor) -> _Kernels | None:
    """The kernels for activations like ``x`` (``[rows, heads, head_dim]``)
    over a layer's ``cache``, when they apply: a CPU, 16/32-bit activations,
    a 16/32-bit, fp8 or int8 cache, heads a multiple of kv heads, a
    contiguous cache (a copy of it would be read or written instead) and the
    library built."""
    heads, kv_heads = x.shape[1], cache.shape[2]
    if not (
        x.device.type == "cpu"
        and (cache.dtype in _C_TYPES or cache.dtype in _FP8_CACHES or cache.dtype == torch.int8)
        and x.dtype in _C_TYPES
        and heads % kv_heads == 0
        and cache.is_contiguous()
    ):
        return None
    return _library(x.shape[2], heads // kv_heads, kv_heads, cache.dtype, x.dtype)


def supports(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether :func:`decode_attention` runs this call (see ``_kernels``)."""
    return v_cache.is_contiguous() and _kernels(q, k_cache) is not None


def _rows(x: Tensor) -> Tensor:
    """``x`` (``[rows, heads, head_dim]``) with each row contiguous, the rows
    any stride apart (q, k and v are often slices of one projection)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scales: Tensor | None = None,
    v_scales: Tensor | None = None,
) -> Tensor:
    """``ops.paged_decode_attention``'s contract for a 16/32-bit, unscaled
    fp8 or int8 cache on a CPU (check :func:`supports` first): ``q [batch,
    heads, head_dim]``, caches ``[num_blocks, block_size, kv_heads,
    head_dim]``, an int8 cache's float16 ``k_scales``/``v_scales``
    ``[num_blocks, block_size, kv_heads]``; returns ``[batch, heads,
    head_dim]`` in ``q.dtype``."""
    kernels = _kernels(q, k_cache)
    int8 = k_cache.dtype == torch.int8
    if kernels is None or not v_cache.is_contiguous() or int8 != _token_scales_fit(k_cache, k_scales, v_scales):
        raise ValueError("cpu_decode cannot run this layout; check supports() first")
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = _c_decode(
        kernels, q, k_cache, v_cache, tables, lens, scale, sliding_window, softcap,
        torch.get_num_threads(), k_scales, v_scales,
    )  # fmt: skip
    if out is None:  # a block larger than the kernel's buffer
        return ref_ops.paged_decode_attention(  # type: ignore[no-any-return]
            q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap,
            k_scales=k_scales, v_scales=v_scales,
        )  # fmt: skip
    return out


def _token_scales_fit(cache: Tensor, k_scales: Tensor | None, v_scales: Tensor | None) -> bool:
    """Whether ``k_scales``/``v_scales`` are per-token int8 scales the kernel
    reads: float16, contiguous, ``[num_blocks, block_size, kv_heads]``."""
    return all(
        s is not None and s.dtype == torch.float16 and s.shape == cache.shape[:3] and s.is_contiguous()
        for s in (k_scales, v_scales)
    )


def _c_decode(
    kernels: _Kernels, q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lens: Tensor,
    scale: float, sliding_window: int | None, softcap: float | None, num_threads: int,
    k_scales: Tensor | None = None, v_scales: Tensor | None = None,
) -> Tensor | None:  # fmt: skip
    """The C decode over int32 ``tables`` / ``lens`` (and an int8 cache's
    scales); None when a block is larger than the kernel's buffer (nothing
    computed)."""
    q = _rows(q)
    batch, heads, head_dim = q.shape
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    out = torch.empty(batch, heads, head_dim, dtype=q.dtype)
    status = kernels.decode(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        out.data_ptr(), batch, q.stride(0), block_size, tables.shape[1], num_blocks, scale,
        sliding_window or 0, softcap or 0.0, num_threads,
        k_scales.data_ptr() if k_scales is not None else None,
        v_scales.data_ptr() if v_scales is not None else None,
    )  # fmt: skip
    return out if status == 0 else None


def _c_write(kernels: _Kernels, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor) -> bool:
    """The C write of rows ``k``/``v`` at int64 ``slots``; False, writing
    nothing, when a slot is out of range."""
    k, v = _rows(k), _rows(v)
    status = kernels.write(
        k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), slots.data_ptr(), slots.shape[0],
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0] * k_cache.shape[1],
    )  # fmt: skip
    return status == 0


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> bool:
    """``ops.write_kv`` for a 16/32-bit or fp8 cache with no scales, as one C loop;
    False (nothing written) where it does not apply or a slot is out of
    range, so the caller can let the reference write or raise."""
    kernels = _kernels(k, k_cache)
    if (
        kernels is None or kernels.write is None or v.dtype != k.dtype
        or not v_cache.is_contiguous() or slot_mapping.dtype != torch.long
    ):  # fmt: skip
        return False
    return _c_write(kernels, k_cache, v_cache, k, v, slot_mapping.contiguous())


class _StepPlan(NamedTuple):
    """What every layer of one decode-only step passes to the C kernels,
    prepared by the step's first layer (``write_and_decode``)."""

    block_tables: Tensor  # the metadata's own tensor: identifies the step
    key: tuple[Any, ...]  # the layout the kernels were picked for
    kernels: _Kernels
    tables: Tensor  # int32, contiguous
    lens: Tensor
    slots: Tensor
    num_threads: int


_PLAN = "cpu_decode.plan"  # the key of a step's plan in its metadata memo


def write_and_decode(
    k_cache: Tensor,
    v_cache: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    memo: dict[Any, Any],
) -> Tensor | None:
    """``write_kv`` then ``paged_decode_attention`` for one layer of a
    decode-only step (one new token per sequence, no scales), as two C calls;
    None, writing nothing, where the kernels do not apply. Between the GEMMs
    of a step each layer's Python runs with cold caches, so the int32 tables,
    lengths and slots the layers share are converted once per step, by the
    first layer, into ``memo``."""
    key = (q.shape, q.dtype, k.dtype, v.dtype, k_cache.shape, k_cache.dtype, v_cache.dtype)
    plan = memo.get(_PLAN)
    if plan is None or plan.block_tables is not block_tables or plan.key != key:
        kernels = _kernels(q, k_cache)
        if (
            kernels is None
            or kernels.write is None  # an int8 cache: its scales are written by the reference
            or k.dtype != q.dtype
            or v.dtype != q.dtype
            or v_cache.dtype != k_cache.dtype
            or slot_mapping.dtype != torch.long
            or k_cache.shape[1] > MAX_BLOCK
        ):
            return None
        plan = _StepPlan(
            block_tables, key, kernels, block_tables.to(torch.int32).contiguous(),
            seq_lens.to(torch.int32).contiguous(), slot_mapping.contiguous(), torch.get_num_threads(),
        )  # fmt: skip
        memo[_PLAN] = plan
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    if not _c_write(plan.kernels, k_cache, v_cache, k, v, plan.slots):
        return None  # a slot out of range: nothing written, the reference raises
    # The block size was checked against the kernel's buffer, so this decode runs.
    return _c_decode(plan.kernels, q, k_cache, v_cache, plan.tables, plan.lens, scale, sliding_window, softcap, plan.num_threads)


# SDPA's CPU flash kernel on 16-bit inputs is much slower when the query or
# key count is not a multiple of 16 (docs/cpu.md), so both are padded.
SDPA_MULTIPLE = 16


def prefill_by_sequence(a: PrefillArgs) -> Tensor:
    """``ops.paged_prefill_attention``'s contract on a CPU, in the model's own
    dtype, one SDPA call per sequence: its blocks taken in order (one
    ``index_select`` of whole blocks per tensor, read as ``[tokens, kv_heads,
    head_dim]``), GQA by SDPA's ``enable_gqa``. A chunk with no cached
    context and no window is plainly causal (``is_causal``, no mask); one
    after cached tokens, or with a window, gets a mask (``_memo_mask``):
    none of the reference's chunked gather, padded queries and step-wide
    masks. SDPA's CPU kernel accumulates and takes the softmax in float32,
    and is faster on 16-bit inputs (AMX / AVX512-BF16). Queries and keys are padded
    to a multiple of ``SDPA_MULTIPLE``: zero keys no real query sees (the
    causal diagonal, or the mask), query rows whose outputs are dropped.
    The lengths are host reads: free on a CPU."""
    q, k_cache, v_cache, window = a.q, a.k_cache, a.v_cache, a.sliding_window
    block_size = k_cache.shape[1]
    cu, lens = a.cu_seqlens_q.tolist(), a.seq_lens.tolist()
    out = torch.empty_like(q)
    for b, (first, last, seq_len) in enumerate(zip(cu, cu[1:], lens, strict=False)):
        q_len = last - first
        if q_len == 0:
            continue
        blocks = a.block_tables[b, : -(-seq_len // block_size)].long()
        # [1, heads, tokens, head_dim]: unbatched (3-D) inputs take SDPA's slow math path (~7x).
        k, v = (_keys(c, blocks, seq_len, _padded(seq_len), q.dtype) for c in (k_cache, v_cache))
        mask = None
        if seq_len != q_len or window is not None:
            mask = _memo_mask(a.memo, q_len, seq_len, window, q.dtype)
        queries = q.new_zeros(1, q.shape[1], _padded(q_len), q.shape[2])
        queries[0, :, :q_len] = q[first:last].transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(
            queries, k, v, attn_mask=mask, is_causal=mask is None, scale=a.scale, enable_gqa=True,
        )  # fmt: skip
        out[first:last] = o[0, :, :q_len].transpose(0, 1)
    return out


def _padded(n: int) -> int:
    return -(-n // SDPA_MULTIPLE) * SDPA_MULTIPLE


def _keys(cache: Tensor, blocks: Tensor, seq_len: int, padded: int, dtype: torch.dtype) -> Tensor:
    """``[1, kv_heads, padded, head_dim]`` in ``dtype``: the sequence's first
    ``seq_len`` tokens of ``cache`` (its ``blocks``, in order), then zeros
    (appended where its blocks hold fewer than ``padded`` tokens). An fp8
    cache's codes widen exactly to a 16-bit ``dtype``."""
    tokens = cache.index_select(0, blocks).flatten(0, 1).to(dtype)  # a copy: its tail is ours to zero
    if tokens.shape[0] < padded:
        tokens = torch.cat([tokens, tokens.new_zeros(padded - tokens.shape[0], *tokens.shape[1:])])
    tokens = tokens[:padded]
    tokens[seq_len:] = 0  # stale or unwritten slots: 0 x NaN would leak into the sums
    return tokens.transpose(0, 1)[None]


def _memo_mask(
    memo: dict[Any, Any] | None, q_len: int, seq_len: int, window: int | None, dtype: torch.dtype
) -> Tensor:
    """The additive mask (0 visible, -inf hidden, in ``dtype``: SDPA would
    convert a boolean one in every call) of ``q_len`` queries ending at
    ``seq_len``: ``attention.context_mask``'s keys, padded as
    ``prefill_by_sequence`` pads: padding keys hidden, padding queries see
    every real key (a row of only -inf would be NaN). Made once per step for
    every layer (``memo``)."""

    def build() -> Tensor:
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(0)
        visible = context_mask(q_pos, torch.tensor([seq_len]), seq_len, window)[0]
        padded = torch.zeros(_padded(q_len), _padded(seq_len), dtype=torch.bool)
        padded[:q_len, :seq_len] = visible
        padded[q_len:, :seq_len] = True
        return ref_ops._additive(padded).to(dtype)

    return ref_ops._memo_get(memo, ("cpu_decode.mask", q_len, seq_len, window, dtype), build)  # type: ignore[no-any-return]


class CpuDecodeOps:
    """An attention-ops module whose ``write_kv`` and ``paged_decode_attention``
    run the C kernels where they apply (on a CPU: 16/32-bit and fp8 caches,
    and int8 ones with per-token scales, which the reference writes); everything else, and every other op, is the wrapped module's.
    The reference write checks its slots with a host sync and runs two
    ``index_copy_`` for a few hundred bytes; the C write is one loop."""

    def __init__(self, ops: ModuleType = ref_ops) -> None:
        self._ops = ops
        self.paged_decode_attention = op(DecodeArgs)(self._decode)
        self.paged_prefill_attention = op(PrefillArgs)(self._prefill)
        self.write_kv = op(WriteKVArgs)(self._write)

    # A prompt chunk whose queries read at most this many keys in all runs
    # through ``write_and_decode``, each row a decode (``cpu_backend.CpuKernelsBackend.attend``):
    # below it that beat ``prefill_by_sequence``, whose cost does not grow with
    # the square of the chunk (the measurements: docs/cpu.md).
    prefill_as_decodes = 16384

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)

    def _decode(self, a: DecodeArgs) -> Tensor:
        """The C kernel for an unscaled 16/32-bit or fp8 cache, or an int8
        one with per-token scales; the reference for static and int4 scales."""
        if a.k_cache.dtype == torch.int8:
            fits = a.k_head_scales is None and a.v_head_scales is None and _token_scales_fit(a.k_cache, a.k_scales, a.v_scales)
        else:
            fits = a.unscaled
        if a.q.shape[0] > 0 and fits and supports(a.q, a.k_cache, a.v_cache):
            return decode_attention(
                a.q, a.k_cache, a.v_cache, a.block_tables, a.seq_lens, a.scale, a.sliding_window,
                a.softcap, a.k_scales, a.v_scales,
            )  # fmt: skip
        return a.pass_to(self._ops.paged_decode_attention)

    write_and_decode = staticmethod(write_and_decode)

    def _prefill(self, a: PrefillArgs) -> Tensor:
        """A 16-bit model over a cache of its own dtype or an unscaled fp8
        one (no soft-cap): ``prefill_by_sequence``. Anything else: the reference."""
        cache = a.k_cache.dtype
        sixteen_bit = a.q.dtype in (torch.bfloat16, torch.float16) and (cache == a.q.dtype or cache in _FP8_CACHES)
        no_keys = a.sliding_window is not None and a.sliding_window < 1  # rows of zeros: the reference's
        if not sixteen_bit or a.softcap or not a.unscaled or a.q.device.type != "cpu" or no_keys:
            return a.pass_to(self._ops.paged_prefill_attention)
        return prefill_by_sequence(a)

    def _write(self, a: WriteKVArgs) -> None:
        if not a.unscaled or not write_kv(a.k_cache, a.v_cache, a.k, a.v, a.slot_mapping):
            a.pass_to(self._ops.write_kv)
