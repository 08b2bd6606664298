"""Batches behave like their sequences alone: packed batched prefill and
batched decode with per-sequence positions, through both pool kinds."""

from __future__ import annotations

import pytest
import torch

PROMPT_LENS = (5, 11, 8)  # different lengths: different positions in every decode step
DECODE_STEPS = 6


def run_view(model, view, ids: list[int], positions: list[int]) -> torch.Tensor:
    """One flat pass through ``view``, committed; logits ``[len(ids), vocab]``."""
    logits = model(torch.tensor(ids), torch.tensor(positions), view)
    view.advance(len(ids))
    return logits


@torch.no_grad()
def _run_batched(model, pool, prompts):
    """Packed batched prefill then batched greedy decode; returns the
    per-sequence prefill logits and the decode logits of each step."""
    seq_ids = [pool.allocate_sequence(p)[0] for p in prompts]
    lens = [len(p) for p in prompts]
    ids = [t for p in prompts for t in p]
    positions = [i for n in lens for i in range(n)]
    logits = run_view(model, pool.batched_prefill_view(seq_ids, lens), ids, positions)
    ends = torch.tensor(lens).cumsum(0).tolist()
    prefill = [logits[end - n : end] for end, n in zip(ends, lens, strict=True)]
    last = torch.stack([logits[end - 1] for end in ends])
    steps = []
    for step in range(DECODE_STEPS):
        tokens = last.argmax(-1).tolist()
        for seq_id, token in zip(seq_ids, tokens, strict=True):
            pool.append_token(seq_id, token)
        last = run_view(model, pool.decode_view(seq_ids), tokens, [n + step for n in lens])
        steps.append(last)
    return prefill, steps


@torch.no_grad()
def _run_alone(model, pool, prompt):
    seq_id, _ = pool.allocate_sequence(prompt)
    prefill = run_view(model, pool.prefill_view(seq_id), prompt, list(range(len(prompt))))
    last, steps = prefill[-1], []
    for step in range(DECODE_STEPS):
        token = int(last.argmax(-1))
        pool.append_token(seq_id, token)
        last = run_view(model, pool.decode_view([seq_id]), [token], [len(prompt) + step])[0]
        steps.append(last)
    pool.free_seq(seq_id)
    return prefill, steps


def _check(checkpoint, pool_of, prompt_of, kind, ops=None):
    model = checkpoint.loaded.model
    prompts = [prompt_of(n, 10 + i) for i, n in enumerate(PROMPT_LENS)]
    batch_prefill, batch_steps = _run_batched(model, pool_of(kind, checkpoint.loaded, ops), prompts)
    for i, prompt in enumerate(prompts):
        # A fresh pool per sequence: no prefix cache or neighbour can leak in.
        prefill, steps = _run_alone(model, pool_of(kind, checkpoint.loaded, ops), prompt)
        torch.testing.assert_close(batch_prefill[i], prefill, atol=1e-5, rtol=0)
        for b_step, step in zip(batch_steps, steps, strict=True):
            torch.testing.assert_close(b_step[i], step, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_batched_prefill_and_decode_equal_each_sequence_alone(checkpoint, kind, pool_of, prompt_of):
    _check(checkpoint, pool_of, prompt_of, kind)


@pytest.mark.backend
def test_batched_decode_on_backend_equals_alone(
    checkpoints, attention_backend, ops_for, pool_of, prompt_of
):
    # Gemma 3 only: GQA, both layer kinds and soft-capping in one model.
    _check(checkpoints["gemma3"], pool_of, prompt_of, "paged", ops_for(attention_backend))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_experts_batched_equal_each_sequence_alone(checkpoints, family, pool_of, prompt_of):
    """The grouped expert path runs every sequence's tokens routed to an
    expert in one GEMM: no sequence's output depends on its neighbours."""
    _check(checkpoints[family], pool_of, prompt_of, "paged")
