"""Building blocks shared by the model families: RMSNorm, attention, gated MLP.

Attention is the one place where a cache view enters model code: with a view
the layer hands the flat batch's new q/k/v (``[num_tokens, heads, head_dim]``)
to ``kv_cache.attend`` and never learns whether the pool behind it is
contiguous or paged; without one it runs plain causal attention over
``[batch, length]`` sequences (tests, one-shot scoring). The step's
``LoRAMapping`` (``lora``, None without adapters) goes to every projection
the same explicit way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from paged_core.protocols import AttentionViewProtocol
from paged_server.models.errors import InvalidConfigError
from paged_server.models.linear import (
    ColumnParallelLinear,
    OutputSlice,
    RowParallelLinear,
    stored_stacked,
)
from paged_server.models.rope import apply_rope
from paged_server.models.tensor_parallel import SINGLE, TensorParallel, shard_heads, shard_size

if TYPE_CHECKING:  # annotations only: a TP rank imports paged_ref inside its start-up guard
    from paged_ref.lora_ops import LoRAMapping

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class LayerOps(Protocol):
    """Fused kernels for a layer's elementwise work (``paged_triton.layer_ops``):
    each matches the eager code it replaces, rounding where it rounds."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


def use_layer_ops(model: nn.Module, ops: LayerOps | None) -> None:
    """Run ``model``'s norms, RoPE and SiLU-mul through ``ops`` (None: eager
    PyTorch). The worker passes its attention backend's ``layer_ops``: the
    Triton kernels on CUDA, where each eager op is a kernel of its own."""
    for module in model.modules():
        if isinstance(module, RMSNorm | GatedMLP | Attention):
            module.layer_ops = ops


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32.

    ``unit_offset=True`` is Gemma's variant: the stored weight is a delta
    from one, ``x * (1 + w)``, multiplied before casting back; Llama and Qwen
    cast back first, then multiply by ``w``. Both orders match their
    reference implementations bit for bit in low precision.
    """

    layer_ops: LayerOps | None = None  # fused kernels (``use_layer_ops``)

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the norm after it: ``(norm(x + delta), x + delta)``."""
        if self.layer_ops is not None and x.dim() == 2:
            return self.layer_ops.add_rms_norm(x, delta, self.weight, self.eps, self.unit_offset)
        x = x + delta
        return self(x), x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layer_ops is not None and x.dim() <= 3:
            return self.layer_ops.rms_norm(x, self.weight, self.eps, self.unit_offset)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU (Llama, Qwen) or GeGLU (Gemma).
    gate and up are one GEMM (``gate_up_proj``, filled from the checkpoint's
    ``gate_proj`` and ``up_proj``). With tensor parallelism each rank holds
    ``1/world_size`` of the intermediate features (gate/up column-, down
    row-parallel). ``stored_as``: the checkpoint already stacks gate and up
    in one tensor of that name (Phi-3's ``gate_up_proj``)."""

    layer_ops: LayerOps | None = None  # fused kernels (``use_layer_ops``)

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str,
        bias: bool = False,
        tp: TensorParallel = SINGLE,
        stored_as: str | None = None,
    ):
        super().__init__()
        if act not in ACTIVATIONS:
            raise InvalidConfigError(
                f"activation {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
            )
        size = shard_size(intermediate_size, tp, "intermediate_size")
        start = tp.rank * size
        slices = [OutputSlice(n, intermediate_size, start, size) for n in ("gate_proj", "up_proj")]
        if stored_as:
            slices = stored_stacked(stored_as, slices)
        self.gate_up_proj = ColumnParallelLinear(hidden_size, slices, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, start, size, bias, tp)
        self.act = ACTIVATIONS[act]
        self.fusable = act == "silu"  # layer_ops has SiLU-mul only

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)
        if self.layer_ops is not None and self.fusable and gate_up.dim() == 2:
            return self.down_proj(self.layer_ops.silu_mul(gate_up), lora)
        gate, up = self.gate_up_proj.split(gate_up)
        return self.down_proj(self.act(gate) * up, lora)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE, optional per-head q/k RMSNorm
    (Qwen 3, Gemma 3), an optional sliding window and logit soft-capping.
    q, k and v are one GEMM (``qkv_proj``, filled from the checkpoint's
    ``q_proj``, ``k_proj`` and ``v_proj``, or from one stacked tensor named
    ``stored_as``, as Phi-3 saves it). ``bias`` is q/k/v's, ``o_bias`` the
    output projection's (Qwen 2 has the first only). With tensor parallelism
    each rank computes its share of the heads (``shard_heads``);
    ``num_heads``/``num_kv_heads`` are then this rank's."""

    layer_ops: LayerOps | None = None  # fused kernels (``use_layer_ops``)

    def __init__(
        self,
        *,
        layer_idx: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        bias: bool = False,
        o_bias: bool | None = None,
        qk_norm: Callable[[], RMSNorm] | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        tp: TensorParallel = SINGLE,
        stored_as: str | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise InvalidConfigError(
                f"num_attention_heads ({num_heads}) is not a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        self.layer_idx = layer_idx
        heads = shard_heads(num_heads, num_kv_heads, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            heads.num_heads,
            heads.num_kv_heads,
            head_dim,
        )
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        q_full, kv_full = num_heads * head_dim, num_kv_heads * head_dim
        q_start, q_size = heads.q_start * head_dim, heads.num_heads * head_dim
        kv_start, kv_size = heads.kv_start * head_dim, heads.num_kv_heads * head_dim
        slices = [
            OutputSlice("q_proj", q_full, q_start, q_size),
            OutputSlice("k_proj", kv_full, kv_start, kv_size),
            OutputSlice("v_proj", kv_full, kv_start, kv_size),
        ]
        if stored_as:
            slices = stored_stacked(stored_as, slices)
        self.qkv_proj = ColumnParallelLinear(hidden_size, slices, bias)
        o_bias = bias if o_bias is None else o_bias
        self.o_proj = RowParallelLinear(q_full, hidden_size, q_start, q_size, o_bias, tp)
        self.q_norm = qk_norm() if qk_norm else None
        self.k_norm = qk_norm() if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: AttentionViewProtocol | None,
        lora: LoRAMapping | None = None,
    ) -> torch.Tensor:
        """``x [..., hidden]`` -> ``[..., hidden]``: a flat ``[num_tokens, hidden]``
        batch with a cache view, or ``[batch, length, hidden]`` sequences
        without one."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(x, lora))
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.layer_ops is not None and q.dim() == 3:  # a flat batch: q and k in place, one launch
            q, k = self.layer_ops.rope(q, k, cos, sin)
        else:
            q, k = apply_rope(q, k, cos, sin)
        if kv_cache is None:
            out = causal_attention(
                q, k, v, scale=self.scale, sliding_window=self.sliding_window, softcap=self.softcap
            )
        else:
            out = kv_cache.attend(
                self.layer_idx,
                q,
                k,
                v,
                scale=self.scale,
                sliding_window=self.sliding_window,
                softcap=self.softcap,
            )
        return self.o_proj(out.flatten(-2), lora)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention over unpadded sequences, no cache (tests, scoring).

    ``q [B, L, H, D]``, ``k``/``v`` ``[B, L, KV, D]``; returns ``[B, L, H, D]``.
    Query ``i`` sees keys ``j <= i`` and, with a window ``w``, ``j > i - w``
    (the rule the cache views follow). Scores, soft-cap and softmax run in
    float32: this is the plain oracle the cached paths are tested against.
    """
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    length = q.shape[2]
    pos = torch.arange(length, device=q.device)
    visible = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        visible &= pos[None, :] > pos[:, None] - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype).transpose(1, 2)
