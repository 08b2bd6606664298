"""The fused-MoE Triton kernel against the models' grouped expert path
(``paged_server.models.moe.Experts``, the reference) on random routings:
decode-sized and prefill-sized token counts, experts with no tokens,
feature sizes that are not multiples of the tiles."""

from __future__ import annotations

import pytest
import torch

from paged_server.models.moe import Experts
from paged_triton.fused_moe import BLOCK_M, align_to_experts, fused_experts

# The kernel runs on the GPU when there is one, else in Triton's interpreter.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _experts(num_experts, hidden, inter, dtype, gen):
    """Random experts whose weights are exactly representable in ``dtype``."""
    experts = Experts(num_experts, hidden, inter, "silu", ("gate", "up", "down"))
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=gen) * 0.2)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=gen) * 0.2)
    return experts.to(dtype)


def _routing(tokens, num_experts, top_k, gen):
    logits = torch.randn(tokens, num_experts, generator=gen)
    logits[:, -1] = -1e9  # the last expert never gets a token
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def test_alignment_groups_pairs_by_expert_in_whole_tiles():
    gen = torch.Generator().manual_seed(0)
    _, ids = _routing(37, 8, 2, gen)
    sorted_ids, block_expert = align_to_experts(ids, 8)
    pairs = ids.numel()
    assert sorted_ids.numel() % BLOCK_M == 0 and block_expert.numel() == sorted_ids.numel() // BLOCK_M
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair once
    tiles = sorted_ids.view(-1, BLOCK_M)
    for tile, expert in zip(tiles, block_expert.tolist(), strict=True):
        members = tile[tile < pairs]
        if expert < 0:
            assert members.numel() == 0
        else:
            assert (ids.flatten()[members.long()] == expert).all()
    assert 7 not in block_expert.tolist()


@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_experts_equal_the_grouped_reference(tokens, dtype):
    gen = torch.Generator().manual_seed(tokens)
    # float32 reference on the kernel's (possibly fp16-rounded) inputs
    experts = _experts(8, 48, 40, dtype, gen).float()  # 48, 40: not multiples of the 64-wide tiles
    x = torch.randn(tokens, 48, generator=gen).to(dtype)
    weights, ids = _routing(tokens, 8, 2, gen)
    want = experts(x.float(), weights, ids)
    w13, w2 = (w.detach().to(DEVICE, dtype) for w in (experts.w13, experts.w2))
    got = fused_experts(x.to(DEVICE), w13, w2, weights.to(DEVICE), ids.to(DEVICE), experts.act)
    assert got.dtype == dtype and got.shape == (tokens, 48)
    tol = dict(atol=1e-5, rtol=0) if dtype == torch.float32 else dict(atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(got.float().cpu(), want, **tol)
