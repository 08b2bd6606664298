"""Shared helpers for the paged-ref tests: random paged layouts and dense oracles."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded generator so every test draws the same random data each run."""
    return torch.Generator().manual_seed(0)


def scatter_to_pages(
    keys: list[Tensor], num_blocks: int, block_size: int, gen: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Place each sequence's ``[kv_heads, len, head_dim]`` tensor into randomly
    chosen, shuffled blocks of a fresh noisy cache, by plain Python loops (an
    oracle independent of ``write_kv``). Returns (cache ``[num_blocks,
    block_size, kv_heads, head_dim]``, block_tables int32)."""
    kv_heads, head_dim = keys[0].shape[0], keys[0].shape[2]
    cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(-(-k.shape[1] // block_size) for k in keys)
    tables = torch.zeros(len(keys), max(max_blocks, 1), dtype=torch.int32)
    for b, k in enumerate(keys):
        for j in range(-(-k.shape[1] // block_size)):
            block = perm.pop()
            tables[b, j] = block
            for off in range(block_size):
                p = j * block_size + off
                if p < k.shape[1]:
                    cache[block, off] = k[:, p]
    return cache, tables


def place_like(values: list[Tensor], tables: Tensor, like: Tensor) -> Tensor:
    """Put ``values`` in the same blocks as a cache built by scatter_to_pages."""
    cache = torch.randn_like(like)
    block_size = cache.shape[1]
    for b, val in enumerate(values):
        for p in range(val.shape[1]):
            cache[int(tables[b, p // block_size]), p % block_size] = val[:, p]
    return cache


def sdpa_oracle(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_start: int,
    scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    """torch SDPA over one sequence: q ``[heads, q_len, D]`` at positions
    ``q_start..``, k/v ``[kv_heads, kv_len, D]``; K/V repeated per group the
    plain way (the oracle may copy). Fully masked rows become zeros."""
    heads, q_len, _ = q.shape
    group = heads // k.shape[0]
    k_rep = k.repeat_interleave(group, dim=0)
    v_rep = v.repeat_interleave(group, dim=0)
    pos = torch.arange(q_start, q_start + q_len).unsqueeze(1)
    keys = torch.arange(k.shape[1]).unsqueeze(0)
    mask = keys <= pos
    if sliding_window is not None:
        mask &= keys > pos - sliding_window
    out = F.scaled_dot_product_attention(
        q.float().unsqueeze(0),
        k_rep.float().unsqueeze(0),
        v_rep.float().unsqueeze(0),
        attn_mask=mask,
        scale=scale,
    )[0]
    return torch.where(mask.any(-1).view(1, q_len, 1), out, torch.zeros_like(out))


def naive_softcap_oracle(
    q: Tensor, k: Tensor, v: Tensor, q_start: int, scale: float, softcap: float
) -> Tensor:
    """Soft-capped causal attention one head at a time, by the formula."""
    heads, q_len, _ = q.shape
    group = heads // k.shape[0]
    out = torch.zeros(heads, q_len, q.shape[-1])
    for h in range(heads):
        kh, vh = k[h // group].double(), v[h // group].double()
        for i in range(q_len):
            t = q_start + i
            s = (kh[: t + 1] @ q[h, i].double()) * scale
            s = softcap * torch.tanh(s / softcap)
            out[h, i] = (torch.softmax(s, 0) @ vh[: t + 1]).float()
    return out


@pytest.fixture
def helpers() -> types.SimpleNamespace:
    """The helpers above, for tests (importlib mode cannot import conftest)."""
    return types.SimpleNamespace(
        scatter_to_pages=scatter_to_pages,
        place_like=place_like,
        sdpa_oracle=sdpa_oracle,
        naive_softcap_oracle=naive_softcap_oracle,
    )


@pytest.fixture
def paged_ops(attention_backend: str) -> types.ModuleType:
    """The ops module of the backend under test, for the paged pool."""
    if attention_backend == "triton":
        return pytest.importorskip("paged_triton.ops")
    from paged_ref import ops

    return ops


@pytest.fixture
def paged_atol(attention_backend: str) -> float:
    """Reference ops share the contiguous path's dense attention: agree to 1e-6.
    Triton kernels sum in another order (online softmax): 1e-5."""
    return 1e-5 if attention_backend == "triton" else 1e-6
