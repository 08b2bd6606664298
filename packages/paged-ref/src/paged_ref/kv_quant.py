"""8-bit KV caches: what each ``kv_cache_dtype`` stores, and the quantize / dequantize math.

Two schemes, chosen for what each 8-bit format can hold:

- ``int8``: symmetric, one scale per (token, kv head): ``scale = absmax / 127``
  over the token's ``head_dim`` values, stored as float16 in tensors shaped
  like the cache without its last dim (``[..., block_size, kv_heads]``).
  A token's scale is written with its K/V and never changes, so a block is
  never requantized, prefix hits and copy-on-write copy scales like values,
  and one outlier token costs only its own precision. The scale costs 2 bytes
  per ``head_dim`` bytes (3% at head_dim 64).
- ``fp8`` (= ``fp8_e4m3``) and ``fp8_e5m2``: a saturating cast with vLLM's
  uncalibrated per-tensor scale of 1.0, so no scale tensor and exactly half
  the bytes of a 16-bit cache. Values beyond the format's largest finite
  number (448 for e4m3, 57344 for e5m2) are clamped to it.
- static scales (vLLM's ``calculate_kv_scales``), for int8 and fp8: one
  float32 scale per (layer, kv head), ``absmax / qmax`` of a calibration
  pass, held by the pool as ``k_head_scales``/``v_head_scales``
  (``[layers, kv_heads]``; the ops take one layer's ``[kv_heads]``). The
  cache stores ``value / scale`` (rounded and clamped to +-127, or cast
  saturating to fp8) and reads ``code * scale``: no per-token scale tensor,
  so an int8 cache is exactly half a 16-bit one, and fp8 uses its whole
  range instead of losing small values to subnormals. Values beyond the
  calibrated range saturate.

- ``int4``: two 4-bit codes per byte with KIVI's per-channel key and
  per-token value scales and zero points, stored per block
  (``paged_ref.kv_int4`` holds that scheme; this module routes to it).

Both backends compute exactly this (``paged_triton`` inside its kernels);
the round trip bounds are tested in ``tests/ref/test_kv_quant.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from paged_ref.kv_int4 import (
    INT4_STORAGE,
    K_GROUP_TOKENS,
    check_head_dim,
    check_int4_scales,
    int4_bytes_per_token,
    is_int4,
    new_int4_scales,
)

# vLLM's names; None = the model's dtype.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "int4": INT4_STORAGE,  # packed: two codes per byte (kv_int4)
}
SCALE_DTYPE = torch.float16  # int8 scales: 2 bytes per token per kv head
INT8_MAX = 127  # symmetric: -127..127, so the scale maps absmax exactly
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
HEAD_SCALE_DTYPE = torch.float32  # static scales: one per (layer, kv head)
# Smallest static scale: an all-zero head still divides by a positive number.
HEAD_SCALE_EPS = 1e-10


def cache_dtype_for(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype a ``kv_cache_dtype`` name asks for (``auto``: the model's)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}"
        )
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def is_quantized(cache_dtype: torch.dtype) -> bool:
    """Whether the cache holds 8- or 4-bit codes rather than model-dtype values."""
    return cache_dtype == torch.int8 or cache_dtype in FP8_MAX or is_int4(cache_dtype)


def has_scales(cache_dtype: torch.dtype, static_scales: bool = False) -> bool:
    """Whether the cache keeps per-token-per-head scale tensors beside K/V
    (int8 without static scales), or per-block ones (int4, always)."""
    return (cache_dtype == torch.int8 and not static_scales) or is_int4(cache_dtype)


def qmax(cache_dtype: torch.dtype) -> float:
    """The largest code a static scale maps a head's absmax to: 127 for int8,
    the format's largest finite number for fp8 (448 e4m3, 57344 e5m2)."""
    if cache_dtype == torch.int8:
        return float(INT8_MAX)
    if cache_dtype in FP8_MAX:
        return FP8_MAX[cache_dtype]
    raise ValueError(f"static KV scales apply to int8 and fp8 caches, not {cache_dtype}")


def head_scales_from_absmax(absmax: Tensor, cache_dtype: torch.dtype) -> Tensor:
    """Static scales (float32, same shape) that map ``absmax`` to ``qmax``,
    floored at ``HEAD_SCALE_EPS``."""
    return (absmax.to(HEAD_SCALE_DTYPE) / qmax(cache_dtype)).clamp(min=HEAD_SCALE_EPS)


def new_scales(cache: Tensor, static_scales: bool = False, name: str = "k_scales") -> Tensor | None:
    """A zeroed scale tensor for ``cache`` (int8: its shape without
    ``head_dim``; int4: ``name`` says whether K's or V's), or None when it
    keeps no per-token scales."""
    if is_int4(cache.dtype):
        if static_scales:
            raise ValueError("static KV scales (calculate_kv_scales) apply to int8 and fp8 caches, not int4")
        return new_int4_scales(cache)[0 if name.startswith("k") else 1]
    if not has_scales(cache.dtype, static_scales):
        return None
    return torch.zeros(cache.shape[:-1], dtype=SCALE_DTYPE, device=cache.device)


def check_head_scales(cache: Tensor, head_scales: Tensor | None, name: str) -> None:
    """Static scales, when given, belong to an 8-bit cache and are one
    contiguous float32 per kv head (``cache.shape[-2]``) on its device."""
    if head_scales is None:
        return
    if not is_quantized(cache.dtype):
        raise ValueError(
            f"{name} given for a {cache.dtype} cache; static scales apply to int8 and fp8 caches"
        )
    kv_heads = cache.shape[-2]
    if (
        head_scales.shape != (kv_heads,)
        or head_scales.dtype != HEAD_SCALE_DTYPE
        or head_scales.device != cache.device
        or not head_scales.is_contiguous()
    ):
        raise ValueError(
            f"{name} must be [{kv_heads}] {HEAD_SCALE_DTYPE} (one per kv head) on the cache's "
            f"device, got {tuple(head_scales.shape)} {head_scales.dtype} on {head_scales.device}"
        )


def check_scales(
    cache: Tensor, scales: Tensor | None, name: str, head_scales: Tensor | None = None
) -> None:
    """Per-token scales must be present (and shaped like ``cache`` minus
    ``head_dim``) for an int8 cache without static ``head_scales``, and
    absent otherwise."""
    if is_int4(cache.dtype):
        if head_scales is not None:
            raise ValueError("static KV scales (calculate_kv_scales) apply to int8 and fp8 caches, not int4")
        check_int4_scales(cache, scales, name)
        return
    check_head_scales(cache, head_scales, f"{name[0]}_head_scales")
    if not has_scales(cache.dtype, head_scales is not None):
        if scales is not None:
            raise ValueError(f"{name} given for a {cache.dtype} cache, which keeps no scales")
        return
    if scales is None:
        raise ValueError(
            f"an int8 cache needs {name} (shape {tuple(cache.shape[:-1])}, {SCALE_DTYPE}) "
            f"beside it, or static {name[0]}_head_scales; build the pool with "
            "kv_cache_dtype='int8'"
        )
    if scales.shape != cache.shape[:-1] or scales.dtype != SCALE_DTYPE:
        raise ValueError(
            f"{name} must be {tuple(cache.shape[:-1])} {SCALE_DTYPE}, got "
            f"{tuple(scales.shape)} {scales.dtype}"
        )


def scale_keywords(
    k_scales: Tensor | None,
    v_scales: Tensor | None,
    k_head_scales: Tensor | None = None,
    v_head_scales: Tensor | None = None,
) -> dict[str, Tensor]:
    """The ops' scale keywords: ``k_scales=``/``v_scales=`` for an int8 cache
    with per-token scales, ``k_head_scales=``/``v_head_scales=`` for static
    ones, and none otherwise (so an ops module written before 8-bit caches
    still serves the other dtypes)."""
    out: dict[str, Tensor] = {}
    if k_scales is not None and v_scales is not None:
        out.update(k_scales=k_scales, v_scales=v_scales)
    if k_head_scales is not None and v_head_scales is not None:
        out.update(k_head_scales=k_head_scales, v_head_scales=v_head_scales)
    return out


def kv_bytes_per_token(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    cache_dtype: torch.dtype,
    static_scales: bool = False,
    block_size: int = K_GROUP_TOKENS,
) -> int:
    """Bytes one token takes across all layers, K and V, per-token scales
    included (static scales are per layer, not per token: none). An int4
    token's share of its block's key scales depends on ``block_size``
    (rounded up)."""
    if is_int4(cache_dtype):
        return int4_bytes_per_token(num_layers, num_kv_heads, head_dim, block_size)
    itemsize = torch.empty((), dtype=cache_dtype, device="meta").element_size()
    scale = SCALE_DTYPE.itemsize if has_scales(cache_dtype, static_scales) else 0
    return 2 * num_layers * num_kv_heads * (head_dim * itemsize + scale)


def logical_shape(cache: Tensor) -> torch.Size:
    """``cache``'s shape with its real ``head_dim`` (an int4 cache packs two per byte)."""
    if is_int4(cache.dtype):
        return torch.Size((*cache.shape[:-1], 2 * cache.shape[-1]))
    return cache.shape


def storage_shape(shape: tuple[int, ...], cache_dtype: torch.dtype) -> tuple[int, ...]:
    """The tensor shape that holds a cache of logical ``shape`` (``[..., head_dim]``)."""
    if is_int4(cache_dtype):
        check_head_dim(shape[-1])
        return (*shape[:-1], shape[-1] // 2)
    return tuple(shape)


def as_bits(t: Tensor) -> Tensor:
    """``t`` viewed as uint8 when it is fp8 (CPU PyTorch cannot index_copy or
    index_select fp8 tensors; moving bytes is the same thing), else ``t``."""
    return t.view(torch.uint8) if t.dtype in FP8_MAX else t


def round_half_away(y: Tensor) -> Tensor:
    """Round to nearest, ties away from zero (what the Triton kernels do with
    ``floor``, so both backends pick the same code)."""
    return torch.where(y >= 0, torch.floor(y + 0.5), -torch.floor(0.5 - y))


def quantize(x: Tensor, cache_dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """``x`` (``[..., head_dim]``, any float dtype) as ``cache_dtype`` codes,
    and the int8 scales (``[...]``, float16; None for other dtypes)."""
    if cache_dtype not in FP8_MAX and cache_dtype != torch.int8:
        return x.to(cache_dtype), None  # a 16/32-bit cache stores the values
    x32 = x.float()
    if cache_dtype == torch.int8:
        scale = (x32.abs().amax(dim=-1) / INT8_MAX).to(SCALE_DTYPE)
        s32 = scale.float().unsqueeze(-1)
        # A zero scale (an all-zero token, or one whose absmax underflows fp16) stores zeros.
        y = torch.where(s32 > 0, x32 / torch.where(s32 > 0, s32, 1.0), 0.0)
        return round_half_away(y).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale
    bound = FP8_MAX[cache_dtype]
    return x32.clamp(-bound, bound).to(cache_dtype), None


def quantize_static(x: Tensor, cache_dtype: torch.dtype, head_scales: Tensor) -> Tensor:
    """``x`` (``[..., kv_heads, head_dim]``) as ``cache_dtype`` codes of
    ``x / head_scales`` (``[kv_heads]`` float32): int8 rounded half away from
    zero and clamped to +-127, fp8 clamped to the format's max and cast.
    Values beyond the calibrated range saturate."""
    y = x.float() / head_scales.to(device=x.device, dtype=HEAD_SCALE_DTYPE).unsqueeze(-1)
    if cache_dtype == torch.int8:
        return round_half_away(y).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    bound = qmax(cache_dtype)
    return y.clamp_(-bound, bound).to(cache_dtype)


def dequantize(
    codes: Tensor,
    scales: Tensor | None,
    dtype: torch.dtype = torch.float32,
    head_scales: Tensor | None = None,
) -> Tensor:
    """Values of ``codes`` (``[..., head_dim]``) in ``dtype``; int8 codes are
    multiplied by their per-token ``scales`` (``[...]``), codes stored with
    static scales by ``head_scales`` (``[kv_heads]``, the codes' second-last axis)."""
    out = codes.to(torch.float32)
    if scales is not None:
        out = out * scales.float().unsqueeze(-1)
    if head_scales is not None:
        out = out * head_scales.to(device=out.device, dtype=HEAD_SCALE_DTYPE).unsqueeze(-1)
    return out.to(dtype)
