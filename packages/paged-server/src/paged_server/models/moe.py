"""A sparse mixture of experts (Mixtral, Qwen 3 MoE): a router picks
``top_k`` of ``num_experts`` gated MLPs per token and mixes their outputs.

The expert path is grouped, not per token: the (token, expert) pairs are
sorted by expert, and each expert with work runs two GEMMs over all of its
tokens at once (a Python loop over experts, never over tokens). This needs
the per-expert counts on the host (one sync per layer). On CUDA the same
computation runs as ``paged_triton.fused_moe`` (one launch per projection
for all experts, no host sync; differential-tested against this path under
the interpreter). Models with experts are not captured in CUDA graphs
(``CausalLM.graph_safe``) until the fused path is proven on a GPU.

With tensor parallelism every rank holds every expert and ``1/world_size``
of each expert's intermediate features (vLLM's default, not expert
parallelism): gate/up rows and down columns, as ``GatedMLP`` shards them,
then one all-reduce sums the partial outputs. The router is replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_server.models.errors import InvalidConfigError
from paged_server.models.layers import ACTIVATIONS
from paged_server.models.linear import Part
from paged_server.models.tensor_parallel import SINGLE, TensorParallel, shard_size


class Router(nn.Module):
    """The gate: ``[tokens, hidden] -> [tokens, num_experts]`` logits. Not an
    ``nn.Linear``, so weight quantization leaves it dense (as vLLM does):
    routing decisions are cheap and sensitive."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Experts(nn.Module):
    """``num_experts`` gated MLPs stacked: ``w13 [E, 2 * I_rank, hidden]``
    (each expert's gate rows then up rows, one GEMM) and ``w2 [E, hidden,
    I_rank]``. ``names``: the checkpoint's gate, up and down tensor names
    per expert (``experts.{e}.{name}.weight``)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        act: str,
        names: tuple[str, str, str],
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        size = shard_size(intermediate_size, tp, "moe_intermediate_size")
        self.full, self.size, self.start = intermediate_size, size, tp.rank * size
        self.names = names
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, size))
        self.act = ACTIVATIONS[act]

    def checkpoint_tensors(self, name: str) -> list[tuple[str, Part]]:
        """Each expert's gate/up rows and down columns of this rank."""
        gate, up, down = self.names
        full, size, start = self.full, self.size, self.start
        parts = []
        for e in range(self.w13.shape[0]):
            prefix = f"{name}.{e}"
            parts += [
                (f"{prefix}.{gate}.weight", Part("w13", 0, start, size, full, 0, index=e)),
                (f"{prefix}.{up}.weight", Part("w13", 0, start, size, full, size, index=e)),
                (f"{prefix}.{down}.weight", Part("w2", 1, start, size, full, 0, index=e)),
            ]
        return parts

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]``, routing ``weights``/``ids [T, top_k]`` -> this
        rank's partial ``[T, hidden]`` (summed over the chosen experts)."""
        if x.is_cuda:
            from paged_triton.fused_moe import fused_experts

            return fused_experts(x, self.w13, self.w2, weights, ids, self.act)
        top_k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        tokens = order // top_k
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()  # host sync
        rows = x[tokens]
        out = torch.empty_like(rows)
        begin = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            h = rows[begin : begin + n]
            gate, up = F.linear(h, self.w13[e]).chunk(2, dim=-1)
            out[begin : begin + n] = F.linear(self.act(gate) * up, self.w2[e])
            begin += n
        out = (out * weights.flatten()[order, None]).to(x.dtype)  # weights: float32
        return torch.zeros_like(x).index_add_(0, tokens, out)


class SparseMoeBlock(nn.Module):
    """Router + experts: softmax over the router logits (float32), keep the
    ``top_k`` largest, renormalize them when ``norm_topk_prob`` (Mixtral
    always does), mix the experts' outputs with those weights."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        act: str,
        norm_topk_prob: bool,
        names: tuple[str, str, str],
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise InvalidConfigError(
                f"num_experts_per_tok ({top_k}) must be between 1 and the number of "
                f"experts ({num_experts})"
            )
        self.top_k, self.norm_topk_prob, self.tp = top_k, norm_topk_prob, tp
        self.gate = Router(hidden_size, num_experts)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, act, names, tp)

    def forward(self, x: torch.Tensor, lora: object = None) -> torch.Tensor:
        """``x [..., hidden]`` -> ``[..., hidden]``; ``lora`` is unused:
        adapters reach attention only (models.lora refuses expert targets)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.gate(flat).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(flat, weights, ids)
        return self.tp.all_reduce(out).reshape(shape)
