"""Checks only a GPU can make; skipped without CUDA (``nox -s gpu`` runs them).

- the real bf16 tensor-core path on a long ragged batch, with the device's
  own split policy (the CPU runs cut contexts with a forced policy);
- a serving step never waits for the device (``torch.cuda`` sync debug
  mode set to raise) and never compiles a new kernel variant when batch,
  block-table width or the metadata's alignment change.

Written without a GPU to run them on: they were last run where
``benchmarks/results/gpu.md`` says (if it exists).
"""

from __future__ import annotations

import pytest
import torch

from paged_ref import ops as ref_ops
from paged_triton import kernel_bench
from paged_triton import ops as triton_ops

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_ragged_long_context_decode_matches_reference(paged):
    """One 32k-token sequence among 63 of 1k, bf16: the long one is split on
    the device (partials allocated in the memo) and merged exactly."""
    step = kernel_bench.decode_step([32768] + [1024] * 63, device="cuda")
    memo: dict = {}
    args = (step.q, step.k_cache, step.v_cache, step.block_tables, step.seq_lens, step.scale)
    out = triton_ops.paged_decode_attention(*args, memo=memo)
    expected = ref_ops.paged_decode_attention(*args)
    paged.assert_close(out, expected, torch.bfloat16)
    rows = [key[1] for key in memo if key[0] == "paged_triton.decode_partials"]
    assert rows and max(rows) > 1, "the 32k sequence was not split"


def _offset(t: torch.Tensor, offset_bytes: int) -> torch.Tensor:
    """``t`` copied to a storage that starts ``offset_bytes`` past an allocation."""
    skip = offset_bytes // t.element_size()
    flat = torch.zeros(t.numel() + skip, dtype=t.dtype, device=t.device)
    out = flat[skip:].view(t.shape)
    out.copy_(t)
    return out


def _variants(*kernels) -> int:
    return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())


def test_steps_never_sync_nor_compile_new_variants():
    from paged_triton.copy_blocks import _copy_blocks_kernel
    from paged_triton.decode_attention import _decode_kernel
    from paged_triton.decode_splits import _merge_splits_kernel
    from paged_triton.prefill_attention import _prefill_kernel
    from paged_triton.write_kv import _write_kv_kernel

    kernels = (_decode_kernel, _merge_splits_kernel, _prefill_kernel, _write_kv_kernel)

    def one_step(contexts: list[int], offset: int) -> None:
        d = kernel_bench.decode_step(contexts, device="cuda")
        p = kernel_bench.prefill_step(contexts, [min(n, 40) for n in contexts], device="cuda")
        tables, lens = _offset(d.block_tables, offset), _offset(d.seq_lens, offset)
        k_new = torch.randn(len(contexts), 8, 128, device="cuda", dtype=torch.bfloat16)
        slots = _offset(torch.arange(len(contexts), device="cuda") * 16, offset)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            memo: dict = {}
            triton_ops.write_kv(d.k_cache, d.v_cache, k_new, k_new, slots)
            triton_ops.paged_decode_attention(
                d.q, d.k_cache, d.v_cache, tables, lens, d.scale, memo=memo
            )
            triton_ops.paged_prefill_attention(
                p.q, d.k_cache, d.v_cache, tables, _offset(p.cu_seqlens_q, offset), lens, p.scale
            )
            caches = torch.stack([d.k_cache, d.k_cache])
            triton_ops.copy_blocks(caches, caches.clone(), [(0, 1), (2, 3)])
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()

    one_step([3000, 40, 700], offset=0)  # compiles every kernel once (the split grid included)
    compiled = _variants(*kernels, _copy_blocks_kernel)
    one_step([5000, 17, 900, 2, 1200], offset=8)
    one_step([600] * 3 + [8000], offset=0)
    one_step([33, 4096], offset=8)
    assert _variants(*kernels, _copy_blocks_kernel) == compiled
