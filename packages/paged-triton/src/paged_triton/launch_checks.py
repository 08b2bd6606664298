"""Host-side checks shared by the kernel wrappers.

Triton fails late and cryptically on a CPU tensor without the interpreter, on
an unsupported dtype or on a cache whose layout the kernels do not expect;
these checks turn each case into an error that says what to do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from paged_ref.kv_int4 import is_int4
from paged_ref.kv_quant import check_scales, has_scales, is_quantized

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# 8-bit caches (paged_ref.kv_quant): fp8 cast with a per-tensor scale of 1, int8 with scales.
# int4: packed codes in uint8, with per-block K and V scales (paged_ref.kv_int4).
QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8)


def interpreted(kernel: object) -> bool:
    """Whether ``kernel`` was built for Triton's CPU interpreter, which
    Triton decides once, when the kernel's module is imported."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_runnable(kernel: object, *tensors: Tensor) -> None:
    """Raise if ``kernel`` cannot run on these tensors' device."""
    first = tensors[0]
    if first.is_cuda:  # the serving path, checked without building device objects
        index = first.get_device()
        if all(t.is_cuda and t.get_device() == index for t in tensors):
            return
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(
            f"paged_triton ops need all tensors on one device, got {sorted(map(str, devices))}"
        )
    device = devices.pop()
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreted(kernel):
        return
    raise RuntimeError(
        f"paged_triton kernels run on CUDA tensors; got {device} tensors. For CPU tensors set "
        "TRITON_INTERPRET=1 before paged_triton.ops is first imported (Triton's interpreter), "
        "or use paged_ref.ops."
    )


def check_cache(k_cache: Tensor, v_cache: Tensor, ndim: int = 4) -> None:
    """K and V caches must agree in shape, dtype and strides (the kernels
    compute one address per token for both) and have unit stride on head_dim."""
    if k_cache.dim() != ndim:
        raise ValueError(f"expected a {ndim}-D cache, got shape {tuple(k_cache.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache "
            f"{tuple(v_cache.shape)} {v_cache.dtype} must match"
        )
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(
            f"k_cache and v_cache need equal strides with head_dim contiguous, got "
            f"{k_cache.stride()} and {v_cache.stride()}; allocate them with torch.empty/zeros"
        )
    if k_cache.dtype not in SUPPORTED_DTYPES + QUANTIZED_DTYPES:
        raise ValueError(
            f"cache dtype {k_cache.dtype} is not supported; use one of "
            f"{SUPPORTED_DTYPES + QUANTIZED_DTYPES}"
        )


def kv_quant_mode(cache_dtype: torch.dtype) -> int:
    """The kernels' ``KV_QUANT`` constexpr: 0 the model's dtype, 1 fp8 (a
    cast), 2 int8 (codes times per-token-per-head scales), 3 int4 (packed
    codes, per-channel key and per-token value scales and mins)."""
    if is_int4(cache_dtype):
        return 3
    if has_scales(cache_dtype):
        return 2
    return 1 if is_quantized(cache_dtype) else 0


def check_quantized_cache(
    k_cache: Tensor,
    k_scales: Tensor | None,
    v_scales: Tensor | None,
    k_head_scales: Tensor | None = None,
    v_head_scales: Tensor | None = None,
    *,
    copy: bool = False,
) -> None:
    """int8 caches need contiguous float16 per-token scales shaped like the
    cache without ``head_dim`` (the kernels index them with the cache's block
    and token), or static ``k_head_scales``/``v_head_scales`` (``[kv_heads]``
    float32); other dtypes take none. ``copy``: a block copy, which needs no
    scales when the cache keeps none per token. fp8 e4m3 needs an sm_89+
    GPU: Triton has no e4m3 (``fp8e4nv``) conversions before Ada (the
    compile matrix shows it)."""
    if k_cache.dtype == torch.float8_e4m3fn and k_cache.is_cuda:
        major, minor = torch.cuda.get_device_capability(k_cache.device)
        if 10 * major + minor < 89:
            raise ValueError(
                f"kv_cache_dtype fp8 / fp8_e4m3 needs compute capability 8.9 or newer for the "
                f"Triton kernels; this GPU is sm_{major}{minor}. Use --kv-cache-dtype fp8_e5m2 "
                "or int8, or --attention-backend ref"
            )
    if (k_head_scales is None) != (v_head_scales is None):
        raise ValueError("give both k_head_scales and v_head_scales, or neither")
    if copy and k_scales is None and v_scales is None:
        return
    check_scales(k_cache, k_scales, "k_scales", k_head_scales)
    check_scales(k_cache, v_scales, "v_scales", v_head_scales)
    for scales in (k_scales, v_scales):
        if scales is not None and (not scales.is_contiguous() or scales.device != k_cache.device):
            raise ValueError(
                "k_scales/v_scales must be contiguous and on the cache's device; allocate them "
                "with paged_ref.kv_quant.new_scales"
            )


def scale_args(
    k_cache: Tensor,
    v_cache: Tensor,
    k_scales: Tensor | None,
    v_scales: Tensor | None,
    k_head_scales: Tensor | None = None,
    v_head_scales: Tensor | None = None,
) -> tuple[Tensor, Tensor, tuple[int, int]]:
    """The kernels' scale pointers and their (block, token) strides: per-token
    scales (int4: K's block stride and V's block stride; the rest follows
    from the contiguous layout), or static per-head ones (strides 0: the kernels add the kv head);
    without scales the caches stand in as pointers the kernels never read."""
    if k_head_scales is not None and v_head_scales is not None:
        return k_head_scales, v_head_scales, (0, 0)
    if k_scales is None or v_scales is None:
        return k_cache, v_cache, (0, 0)
    if is_int4(k_cache.dtype):  # K and V scales differ in shape: each one's block stride
        return k_scales, v_scales, (k_scales.stride(0), v_scales.stride(0))
    return k_scales, v_scales, (k_scales.stride(0), k_scales.stride(1))


def compute_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """What the attention products run in: the cache's dtype, or for an 8-bit
    cache (dequantized tile by tile in registers) the query's."""
    return q_dtype if is_quantized(cache_dtype) else cache_dtype


def check_gqa(heads: int, kv_heads: int) -> int:
    """Query heads per kv head (1 for MHA, ``heads`` for MQA)."""
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(
            f"query heads ({heads}) must be a multiple of kv heads ({kv_heads}) for GQA/MQA"
        )
    return heads // kv_heads


def last_dim_contiguous(t: Tensor) -> Tensor:
    """``t`` itself when its last dim has unit stride (views of a fused QKV
    projection qualify), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def as_index(t: Tensor, like: Tensor, dtype: torch.dtype = torch.int32) -> Tensor:
    """Index metadata as contiguous ``dtype`` on ``like``'s device (``t`` itself
    when it already is: the step's metadata is built that way). Slot indices
    are int64: they can exceed 2**31 in huge pools."""
    same_device = t.is_cuda == like.is_cuda and t.get_device() == like.get_device()
    if t.dtype is dtype and same_device and t.is_contiguous():
        return t
    return t.to(device=like.device, dtype=dtype).contiguous()


def dot_precision(dtype: torch.dtype) -> str:
    """float32 caches get exact fp32 products (``ieee``) rather than TF32,
    so float32 results match the float32 reference; 16-bit inputs ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"
