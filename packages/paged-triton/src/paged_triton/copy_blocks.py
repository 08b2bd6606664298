"""Copy whole cache blocks ``src -> dst`` in every layer (copy-on-write).

A block is contiguous inside its layer (``block_size * kv_heads * head_dim``
elements), so a program copies one flat chunk of one block of one layer,
for K and V together. Copies run in parallel, so when a destination is also
some pair's source the sources are first snapshotted: every source is read
before any destination is written, as in ``paged_ref.ops.copy_blocks``.

The pairs come from the host (the pool batches a step's copy-on-writes), are
checked there, and reach the device in one copy; nothing is read back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_ref.kv_quant import as_bits
from paged_ref.op_args import CopyBlocksArgs, op
from paged_triton.launch import Launch
from paged_triton.launch_checks import check_cache, check_quantized_cache, check_runnable

CHUNK = 1024  # elements per program


@triton.jit(do_not_specialize_on_alignment=["PAIRS"])
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


def plan_copy_blocks(
    src_k: Tensor, src_v: Tensor, k_caches: Tensor, v_caches: Tensor, pairs: Tensor
) -> Launch:
    """Programs (pair, layer, chunk); ``pairs`` is ``[n, 2]`` int64 on the
    caches' device, indexing ``src_k``'s blocks and ``k_caches``' blocks."""
    layers = k_caches.shape[0]
    block_elems = k_caches[0, 0].numel()
    return Launch(
        _copy_blocks_kernel,
        (pairs.shape[0], layers, triton.cdiv(block_elems, CHUNK)),
        (
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
        ),
        dict(CHUNK=CHUNK),
        num_warps=4,
        num_stages=1,
    )


@op(CopyBlocksArgs)
def copy_blocks(a: CopyBlocksArgs) -> None:
    """Copy blocks ``src -> dst`` in all layers of ``k_caches``/``v_caches``
    (``[layers, num_blocks, block_size, kv_heads, head_dim]``). ``src_to_dst``:
    host pairs, a list of ``(src, dst)`` or a CPU int64 tensor ``[n, 2]``
    (a device tensor works too but is read back first, a sync). An int8
    cache's per-token scales (``[layers, num_blocks, block_size, kv_heads]``)
    are copied by a second launch of the same kernel; static scales are per
    layer, so a cache with them passes none. Same contract as
    ``paged_ref.ops.copy_blocks``; one host-to-device copy per call.
    """
    k_caches, v_caches, k_scales, v_scales = a.k_caches, a.v_caches, a.k_scales, a.v_scales
    check_runnable(_copy_blocks_kernel, k_caches, v_caches)
    check_cache(k_caches, v_caches, ndim=5)
    check_quantized_cache(k_caches, k_scales, v_scales, copy=True)
    layers, num_blocks = k_caches.shape[:2]
    inner = k_caches.shape[2:]
    if k_caches.stride()[2:] != (inner[1] * inner[2], inner[2], 1):
        raise ValueError(
            f"each cache block must be contiguous (strides {k_caches.stride()}); "
            "allocate the caches with torch.empty/zeros"
        )
    pairs = torch.as_tensor(a.src_to_dst, dtype=torch.int64).reshape(-1, 2).cpu()
    if pairs.shape[0] == 0 or layers == 0:
        return
    if int(pairs.min()) < 0 or int(pairs.max()) >= num_blocks:
        raise ValueError(f"src_to_dst holds block ids outside [0, {num_blocks}): {pairs.tolist()}")
    tensors = [(k_caches, v_caches)]
    if k_scales is not None and v_scales is not None:
        if k_scales.shape == v_scales.shape:
            tensors.append((k_scales, v_scales))
        else:  # int4: K's per-group and V's per-token scales, one launch each
            tensors += [(k_scales, k_scales), (v_scales, v_scales)]
    if set(pairs[:, 0].tolist()) & set(pairs[:, 1].tolist()):
        # A destination is also a source: copy from a snapshot of the sources,
        # gathered with the same single upload ((i, dst) pairs, then the sources).
        n = pairs.shape[0]
        snapshot_pairs = torch.stack([torch.arange(n), pairs[:, 1]], dim=1)
        device_ids = torch.cat([snapshot_pairs.reshape(-1), pairs[:, 0]]).to(
            k_caches.device, non_blocking=True
        )
        sources = device_ids[2 * n :]
        device_pairs = device_ids[: 2 * n].view(n, 2)
        for k, v in tensors:
            # (as raw bytes: CPU PyTorch cannot index fp8 tensors)
            snapshot_k = as_bits(k)[:, sources].view(k.dtype)
            snapshot_v = as_bits(v)[:, sources].view(v.dtype)
            plan_copy_blocks(snapshot_k, snapshot_v, k, v, device_pairs).run()
        return
    device_pairs = pairs.contiguous().to(k_caches.device, non_blocking=True)
    for k, v in tensors:
        plan_copy_blocks(k, v, k, v, device_pairs).run()
