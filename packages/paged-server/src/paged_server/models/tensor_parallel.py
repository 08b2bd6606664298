"""Tensor-parallel building blocks: which slice of each weight a rank holds.

Megatron's split, as vLLM does it: the q/k/v and gate/up projections are
*column-parallel* (each rank computes some output features: its attention
heads, its part of the MLP), the output and down projections *row-parallel*
(each rank multiplies its input features and one all-reduce sums the
partial results). So a decoder layer costs two all-reduces. Embeddings,
norms and the LM head are replicated: every rank holds them whole.

When a model has fewer KV heads than ranks (Gemma 3 1B has one), each KV
head is replicated on ``world_size / num_kv_heads`` ranks, as in vLLM.

The parallel linear layers themselves live in ``linear.py``; each records
the slices it holds so the loader reads only those from the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from paged_server.models.errors import InvalidConfigError


class AllReduce(Protocol):
    """Sums a tensor across ranks, in place (``paged_server.parallel.TPGroup``)."""

    def all_reduce(self, tensor: torch.Tensor) -> None: ...


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This rank's place: ``rank`` of ``world_size``; ``group`` sums partial
    results (``None`` for one rank, or to build and load one rank's shard
    without any communication, as the loader tests do)."""

    rank: int = 0
    world_size: int = 1
    group: AllReduce | None = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            if self.group is None:
                raise RuntimeError(
                    f"rank {self.rank} of {self.world_size} has no process group to all-reduce with"
                )
            self.group.all_reduce(tensor)
        return tensor


SINGLE = TensorParallel()


@dataclass(frozen=True, slots=True)
class HeadShard:
    """The attention heads one rank computes: ``num_heads`` query heads from
    ``q_start`` and ``num_kv_heads`` KV heads from ``kv_start``."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


def shard_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadShard:
    """Split query heads evenly; split KV heads too, or replicate them when
    there are fewer KV heads than ranks. Raises ``InvalidConfigError`` for
    counts that do not divide."""
    world, rank = tp.world_size, tp.rank
    if num_heads % world:
        raise InvalidConfigError(
            f"num_attention_heads ({num_heads}) is not divisible by tensor_parallel_size "
            f"({world}); choose a tensor_parallel_size that divides it"
        )
    if num_kv_heads >= world:
        if num_kv_heads % world:
            raise InvalidConfigError(
                f"num_key_value_heads ({num_kv_heads}) is not divisible by "
                f"tensor_parallel_size ({world}); choose a tensor_parallel_size that divides it"
            )
        kv_local = num_kv_heads // world
        return HeadShard(num_heads // world, kv_local, rank * num_heads // world, rank * kv_local)
    if world % num_kv_heads:
        raise InvalidConfigError(
            f"tensor_parallel_size ({world}) exceeds num_key_value_heads ({num_kv_heads}) and "
            "is not a multiple of it, so KV heads cannot be replicated evenly across ranks"
        )
    # Replicated: rank r's query heads all belong to KV head r * kv / world.
    return HeadShard(num_heads // world, 1, rank * num_heads // world, rank * num_kv_heads // world)


def shard_size(full: int, tp: TensorParallel, what: str) -> int:
    """``full / world_size``, or a clear error when it does not divide."""
    if full % tp.world_size:
        raise InvalidConfigError(
            f"{what} ({full}) is not divisible by tensor_parallel_size ({tp.world_size})"
        )
    return full // tp.world_size
