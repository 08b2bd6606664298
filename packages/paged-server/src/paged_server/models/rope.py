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
    ``low_freq_factor``), keeps the high ones and interpolates in between;
    ``freq_factors`` (a GGUF file's ``rope_freqs``) divide each frequency by its own.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (params.theta**exponents)
    if params.rope_type == "longrope":
        return _longrope_scale(params, params.short_factor, exponents, head_dim)
    if params.rope_type == "linear":
        inv_freq = inv_freq / params.factor
    elif params.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, params, max_position_embeddings)
    if params.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(params.freq_factors, dtype=torch.float32, device="cpu")
    return inv_freq


def _longrope_scale(
    p: RopeParams, factors: list[float] | None, exponents: torch.Tensor, head_dim: int
) -> torch.Tensor:
    if factors is None or len(factors) != head_dim // 2:
        raise ValueError(
            f"longrope needs short_factor and long_factor of head_dim / 2 = {head_dim // 2} "
            "values each in rope_scaling"
        )
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * p.theta**exponents)


def longrope_attention_factor(p: RopeParams) -> float:
    """The cos/sin scale of longrope: the config's, or ``sqrt(1 + ln(factor) /
    ln(original context))`` for a context stretched ``factor`` times."""
    if p.attention_factor is not None:
        return p.attention_factor
    if p.factor <= 1.0:
        return 1.0
    orig = p.original_max_position_embeddings
    assert orig, "longrope needs original_max_position_embeddings"
    return math.sqrt(1 + math.log(p.factor) / math.log(orig))


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

    longrope (Phi-3) rotates positions from ``original_max_position_embeddings``
    on with the long factors, earlier ones with the short factors: a per-token
    rule, so one sequence's length never changes another's angles in a mixed
    batch. transformers picks one set per forward pass (long once any position
    reaches the original context); both agree while a pass stays below it.
    """

    def __init__(self, params: RopeParams, head_dim: int, max_position_embeddings: int) -> None:
        super().__init__()
        self.inv_freq = rope_inv_freq(params, head_dim, max_position_embeddings)
        self.long_inv_freq: torch.Tensor | None = None
        self.long_from = 0
        self.scale = 1.0
        if params.rope_type == "longrope":
            exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
            self.long_inv_freq = _longrope_scale(params, params.long_factor, exponents, head_dim)
            self.long_from = params.original_max_position_embeddings or max_position_embeddings
            self.scale = longrope_attention_factor(params)

    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Angles in float32 (exact for large positions), returned in ``dtype``."""
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids.float()[..., None] * self.inv_freq
        if self.long_inv_freq is not None:
            if self.long_inv_freq.device != position_ids.device:
                self.long_inv_freq = self.long_inv_freq.to(position_ids.device)
            long = position_ids.float()[..., None] * self.long_inv_freq
            freqs = torch.where(position_ids[..., None] >= self.long_from, long, freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.scale != 1.0:
            return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)
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
