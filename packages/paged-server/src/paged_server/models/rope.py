"""Rotary position embeddings with the scaling rules the supported families use.

Angles are computed from each token's own position (``position_ids``), so a
batch may hold sequences at different positions (continuous batching) and
nothing is tabulated up to ``max_position_embeddings``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from paged_server.models.config import RopeParams


def rope_inv_freq(params: RopeParams, head_dim: int, max_position_embeddings: int) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32, CPU) for ``params``.

    ``linear`` divides every frequency by ``factor``; ``llama3`` divides only
    the low frequencies (wavelengths longer than the original context /
    ``low_freq_factor``), keeps the high ones and interpolates in between.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (params.theta**exponents)
    if params.rope_type == "linear":
        return inv_freq / params.factor
    if params.rope_type == "llama3":
        return _llama3_scale(inv_freq, params, max_position_embeddings)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, p: RopeParams, max_pos: int) -> torch.Tensor:
    old_context = p.original_max_position_embeddings or max_pos
    low_freq_wavelen = old_context / p.low_freq_factor
    high_freq_wavelen = old_context / p.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / p.factor, inv_freq)
    smooth = (old_context / wavelen - p.low_freq_factor) / (p.high_freq_factor - p.low_freq_factor)
    smoothed = (1 - smooth) * scaled / p.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Turns ``position_ids [...]`` into ``cos, sin [..., head_dim]``.

    The frequencies are a plain attribute, not a buffer, so a model built on
    the meta device (the loader does that) still has real frequencies.
    """

    def __init__(self, params: RopeParams, head_dim: int, max_position_embeddings: int) -> None:
        super().__init__()
        self.inv_freq = rope_inv_freq(params, head_dim, max_position_embeddings)

    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Angles in float32 (exact for large positions), returned in ``dtype``."""
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q``/``k`` ``[..., heads, D]`` by per-token angles ``[..., D]``
    (the half-split layout Hugging Face checkpoints are trained with)."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
