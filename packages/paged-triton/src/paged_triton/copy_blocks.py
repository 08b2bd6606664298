"""Copy whole cache blocks ``src -> dst`` in every layer (copy-on-write).

A block is contiguous inside its layer (``block_size * kv_heads * head_dim``
elements), so a program copies one flat chunk of one block of one layer,
for K and V together. Copies run in parallel, so when a destination is also
some pair's source the sources are first snapshotted: every source is read
before any destination is written, as in ``paged_ref.ops.copy_blocks``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_triton.launch_checks import check_cache, check_runnable

CHUNK = 1024  # elements per program


@triton.jit
def _copy_blocks_kernel(
    SRC_K,
    SRC_V,
    DST_K,
    DST_V,
    PAIRS,
    src_stride_l,
    src_stride_b,
    dst_stride_l,
    dst_stride_b,
    block_elems,
    CHUNK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    e = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = e < block_elems
    src = layer * src_stride_l + tl.load(PAIRS + 2 * i) * src_stride_b + e
    dst = layer * dst_stride_l + tl.load(PAIRS + 2 * i + 1) * dst_stride_b + e
    tl.store(DST_K + dst, tl.load(SRC_K + src, mask=mask), mask=mask)
    tl.store(DST_V + dst, tl.load(SRC_V + src, mask=mask), mask=mask)


def copy_blocks(k_caches: Tensor, v_caches: Tensor, src_to_dst: Tensor) -> None:
    """Copy blocks ``src_to_dst[:, 0] -> src_to_dst[:, 1]`` in all layers of
    ``k_caches``/``v_caches`` (``[layers, num_blocks, block_size, kv_heads, head_dim]``).
    Same contract as ``paged_ref.ops.copy_blocks``. Reads the pairs on the
    host once (a sync on CUDA; CoW copies are rare and off the decode path).
    """
    check_runnable(_copy_blocks_kernel, k_caches, v_caches)
    check_cache(k_caches, v_caches, ndim=5)
    layers, num_blocks = k_caches.shape[:2]
    block_elems = k_caches[0, 0].numel()
    inner = k_caches.shape[2:]
    if k_caches.stride()[2:] != (inner[1] * inner[2], inner[2], 1):
        raise ValueError(
            f"each cache block must be contiguous (strides {k_caches.stride()}); "
            "allocate the caches with torch.empty/zeros"
        )
    if src_to_dst.numel() == 0 or layers == 0:
        return
    pairs_host = src_to_dst.reshape(-1, 2).to(device="cpu", dtype=torch.int64)
    if int(pairs_host.min()) < 0 or int(pairs_host.max()) >= num_blocks:
        raise ValueError(
            f"src_to_dst holds block ids outside [0, {num_blocks}): {pairs_host.tolist()}"
        )
    src_k, src_v = k_caches, v_caches
    if set(pairs_host[:, 0].tolist()) & set(pairs_host[:, 1].tolist()):
        # A destination is also a source: copy from a snapshot of the sources.
        src_k, src_v = k_caches[:, pairs_host[:, 0]], v_caches[:, pairs_host[:, 0]]
        pairs_host = torch.stack([torch.arange(pairs_host.shape[0]), pairs_host[:, 1]], dim=1)
    pairs = pairs_host.to(k_caches.device).contiguous()
    grid = (pairs.shape[0], layers, triton.cdiv(block_elems, CHUNK))
    _copy_blocks_kernel[grid](
        src_k,
        src_v,
        k_caches,
        v_caches,
        pairs,
        src_k.stride(0),
        src_k.stride(1),
        k_caches.stride(0),
        k_caches.stride(1),
        block_elems,
        CHUNK=CHUNK,
        num_warps=4,
    )
