"""paged-triton: fused Triton kernels with the reference ops' signatures.

``paged_triton.ops`` exports ``write_kv``, ``paged_decode_attention``,
``paged_prefill_attention`` and ``copy_blocks`` with the same arguments and
results as ``paged_ref.ops`` (docs/contracts.md, "Attention ops"). Importing
this package does not import Triton; ``is_available()`` says whether the ops
can run here before anyone imports them.
"""

from __future__ import annotations

import os

import torch

__all__ = ["is_available"]


def is_available() -> bool:
    """True when the kernels can run: a CUDA GPU is present, or Triton's CPU
    interpreter is switched on (``TRITON_INTERPRET=1``, read by Triton when
    ``paged_triton.ops`` is first imported)."""
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"
