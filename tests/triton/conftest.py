"""Shared helpers for the Triton-vs-reference differential tests.

Without a GPU the kernels run in Triton's CPU interpreter, which Triton
switches on when the kernels are first imported, so the variable is set here
before any test module imports ``paged_triton.ops``.

Helpers reach tests through the session fixture ``paged`` (importlib mode
cannot import a conftest).
"""

from __future__ import annotations

import os
import types
from typing import Any

import pytest
import torch
from torch import Tensor

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Tolerances (max abs and relative difference, Triton vs paged_ref.ops):
# - float32: both sides compute in float32 and differ only in summation order
#   (tiles of 64 keys, online rescaling), ~1e-6 on outputs of size ~1;
#   2e-5 leaves room for a few hundred keys without hiding a wrong mask
#   (one wrongly included key moves the output by ~1e-3 or more).
# - float16: the reference upcasts K/V and keeps probabilities in float32;
#   the kernel multiplies probabilities rounded to float16 (rel. 2**-11) with
#   V, and both round the result to float16 (half an ulp, 2**-12 rel.).
#   Outputs are weighted means of N(0, 1) values, |out| < ~3, so 3e-3 covers
#   a couple of ulps plus the probability rounding.
# - bfloat16: 8-bit mantissa, ulp 2**-7 near 1: 3e-2. Runs on CPU too: in
#   the interpreter the kernels upcast the bf16 tiles to float32 right before
#   tl.dot (the interpreter's bf16 dot is wrong), so loads, stores, casts and
#   the probability rounding are the GPU's; the GPU's bf16 dot itself is
#   covered by the compile matrix and the `cuda` tests.
# - 8-bit caches (int8, fp8_e4m3, fp8_e5m2): the same tolerances, keyed by
#   the query's dtype. Quantization error itself cancels: both sides read the
#   same codes and scales (write_kv is compared bit for bit) and dequantize
#   them exactly (code * float16 scale is exact in float32). What differs is
#   where the products run: the reference in float32, the kernel in the
#   query's dtype, so a float16/bfloat16 query adds one rounding of each
#   dequantized value (rel. 2**-11 / 2**-8) to what the rows above cover.
#   float32 queries keep float32 products (ieee) and the 2e-5 bound.
#   With static per-head scales (calculate_kv_scales) the same holds: both
#   sides compute code * float32 scale as one IEEE float32 product (one
#   rounding, the same on both), and write_kv is again compared bit for bit.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def random_block_tables(
    lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator, share: bool = True
) -> Tensor:
    """Page tables over a random permutation of the physical blocks.

    With ``share``, every other sequence reuses the leading full blocks of
    sequence 0 (a prefix-cache hit or a fork), so one physical block appears
    in several tables. Unused entries hold random block ids: the kernels
    must never read them. Returns ``[batch, max_blocks]`` int32.
    """
    need = [-(-n // block_size) for n in lens]
    max_blocks = max([*need, 1])
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    if sum(need) > num_blocks:
        raise ValueError(f"{sum(need)} blocks needed but the pool has {num_blocks}")
    tables = torch.randint(0, num_blocks, (len(lens), max_blocks), generator=gen, dtype=torch.int32)
    for b, n in enumerate(need):
        for j in range(n):
            tables[b, j] = perm.pop()
    if share and len(lens) > 1:
        full0 = lens[0] // block_size
        for b in range(1, len(lens), 2):
            shared = min(full0, lens[b] // block_size)
            tables[b, :shared] = tables[0, :shared]
    return tables


def random_caches(
    num_blocks: int,
    kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """K and V caches ``[num_blocks, block_size, kv_heads, head_dim]`` of
    N(0, 1) values (noise in unused blocks too)."""
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    v = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    return k, v


def random_quantized_caches(
    num_blocks: int,
    kv_heads: int,
    block_size: int,
    head_dim: int,
    kv_dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """8-bit K and V caches (codes of N(0, 1) values, noise in unused blocks
    too) and, for int8, their scales ``[num_blocks, block_size, kv_heads]``."""
    from paged_ref.kv_quant import quantize

    shape = (num_blocks, block_size, kv_heads, head_dim)
    k, k_scales = quantize(torch.randn(shape, generator=gen), kv_dtype)
    v, v_scales = quantize(torch.randn(shape, generator=gen), kv_dtype)
    move = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return k.to(DEVICE), v.to(DEVICE), move(k_scales), move(v_scales)


def random_static_quantized_caches(
    num_blocks: int,
    kv_heads: int,
    block_size: int,
    head_dim: int,
    kv_dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """8-bit K and V caches holding codes of N(0, s_h) values under static
    per-head scales (each head its own magnitude, as calibration gives), and
    those scales ``[kv_heads]`` float32 for K and V."""
    from paged_ref.kv_quant import head_scales_from_absmax, quantize_static

    shape = (num_blocks, block_size, kv_heads, head_dim)
    out = []
    for _ in range(2):
        spread = torch.linspace(0.5, 1.5, kv_heads).view(1, 1, kv_heads, 1)  # ~N(0, 1) outputs
        x = torch.randn(shape, generator=gen) * spread
        scales = head_scales_from_absmax(x.abs().amax(dim=(0, 1, 3)), kv_dtype)
        out.append((quantize_static(x, kv_dtype, scales).to(DEVICE), scales.to(DEVICE)))
    (k, k_scales), (v, v_scales) = out
    return k, v, k_scales, v_scales


def blocks_needed(lens: list[int], block_size: int) -> int:
    """Physical blocks for these lengths plus spare noise blocks."""
    return sum(-(-n // block_size) for n in lens) + 4


def assert_close(actual: Tensor, expected: Tensor, dtype: torch.dtype) -> None:
    """Finite, same shape and dtype, and within the dtype's tolerance."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.isfinite(actual).all(), "Triton output has NaN/inf"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype])


def decode_attention(*args: Any, policy: Any = None, **kwargs: Any) -> Tensor:
    """``paged_decode_attention`` with the split policy forced to ``policy``
    (a ``SplitPolicy``; ``None``: the device's), so CPU runs cover the split path."""
    from paged_triton import decode_attention as module

    with pytest.MonkeyPatch.context() as patch:
        if policy is not None:
            patch.setattr(module, "split_policy", lambda device: policy)
        return module.paged_decode_attention(*args, **kwargs)


@pytest.fixture(scope="session")
def paged() -> types.SimpleNamespace:
    """The helpers above, for tests and hypothesis strategies."""
    return types.SimpleNamespace(
        device=DEVICE,
        random_block_tables=random_block_tables,
        random_caches=random_caches,
        random_quantized_caches=random_quantized_caches,
        random_static_quantized_caches=random_static_quantized_caches,
        blocks_needed=blocks_needed,
        assert_close=assert_close,
        decode_attention=decode_attention,
    )


@pytest.fixture(params=[torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    """Every differential test runs per cache dtype."""
    return request.param


@pytest.fixture
def gen() -> torch.Generator:
    """Seeded, so each test draws the same data every run."""
    return torch.Generator().manual_seed(0)
