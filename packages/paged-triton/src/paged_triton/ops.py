"""The four paged attention ops as fused Triton kernels.

Same names, arguments and results as ``paged_ref.ops`` (docs/contracts.md,
"Attention ops"); pools take either module as their ``ops``. Runs on CUDA
tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``
set before this module is first imported).
"""

from __future__ import annotations

from paged_triton.copy_blocks import copy_blocks
from paged_triton.decode_attention import paged_decode_attention
from paged_triton.prefill_attention import paged_prefill_attention
from paged_triton.write_kv import write_kv

__all__ = ["copy_blocks", "paged_decode_attention", "paged_prefill_attention", "write_kv"]
