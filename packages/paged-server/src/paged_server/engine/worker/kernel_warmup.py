"""Compile every Triton kernel variant the engine can launch, at start-up.

Triton compiles a kernel variant the first time it is launched; in the
middle of serving that is a stall of seconds for whoever is in the batch.
The variants depend only on the model's attention layout and the pool
(``paged_triton.warmup``), so the engine compiles them all before the
first request, on CUDA with the Triton kernels and the paged pool (the
contiguous pool always runs the reference ops), and logs how long it took.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from paged_ref.kv_tensors import KVCacheTensors
from paged_server.models.layers import Attention
from paged_triton.warmup import AttentionLayout, LayerAttention

log = logging.getLogger(__name__)


def attention_layout(
    model: nn.Module, dtype: torch.dtype, tensors: KVCacheTensors, max_model_len: int
) -> AttentionLayout:
    """The ``paged_triton.warmup.AttentionLayout`` of ``model`` (this rank's
    heads; each layer's window and soft-cap exactly as it passes them to
    the ops) over the KV cache ``tensors``."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention layers to warm up")
    first = layers[0]
    return AttentionLayout(
        num_heads=first.num_heads,
        num_kv_heads=first.num_kv_heads,
        head_dim=first.head_dim,
        dtype=dtype,
        kv_cache_dtype=tensors.k_cache.dtype,
        block_size=tensors.block_size,
        num_blocks=tensors.num_blocks,  # copy_blocks' layer stride
        max_model_len=max_model_len,
        layers=tuple(LayerAttention(m.sliding_window, m.softcap or None) for m in layers),
        static_kv_scales=tensors.k_head_scales is not None,
    )


def warm_up_kernels(
    model: nn.Module,
    dtype: torch.dtype,
    tensors: KVCacheTensors,
    max_model_len: int,
    device: torch.device,
) -> int:
    """Compile (on CUDA) every variant the cache's backend launches
    (``AttentionBackend.warm_up``); logs one line and returns how many."""
    layout = attention_layout(model, dtype, tensors, max_model_len)
    done = tensors.backend.warm_up(layout, device)
    if done.compiled:
        log.info("compiled %d Triton kernel variants in %.1f s", len(done.variants), done.seconds)
    else:
        log.debug("%d Triton kernel variants (interpreter: nothing to compile)", len(done.variants))
    return len(done.variants)
