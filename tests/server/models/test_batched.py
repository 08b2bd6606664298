"""Batches behave like their sequences alone: right-padded batched prefill and
batched decode with per-sequence position_ids, through both pool kinds."""

from __future__ import annotations

import pytest
import torch

PROMPT_LENS = (5, 11, 8)  # different lengths: different positions in every decode step
DECODE_STEPS = 6


@torch.no_grad()
def _run_batched(model, pool, prompts):
    """Batched prefill (right padded) then batched greedy decode; returns the
    per-sequence prefill logits and the decode logits of each step."""
    slots = [pool.allocate_sequence(p)[0] for p in prompts]
    lens = [len(p) for p in prompts]
    width = max(lens)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    positions = torch.arange(width).expand(len(prompts), -1)
    logits = model(ids, positions, pool.batched_prefill_view(slots, lens))
    prefill = [logits[i, : lens[i]] for i in range(len(prompts))]
    last = torch.stack([logits[i, lens[i] - 1] for i in range(len(prompts))])
    steps = []
    for step in range(DECODE_STEPS):
        tokens = last.argmax(-1)
        for slot, token in zip(slots, tokens.tolist(), strict=True):
            pool.append_token(slot, token)
        pos = torch.tensor([[n + step] for n in lens])
        last = model(tokens[:, None], pos, pool.decode_view(slots))[:, -1]
        steps.append(last)
    return prefill, steps


@torch.no_grad()
def _run_alone(model, pool, prompt):
    slot, _ = pool.allocate_sequence(prompt)
    logits = model(torch.tensor([prompt]), torch.arange(len(prompt))[None], pool.prefill_view(slot))
    prefill, last, steps = logits[0], logits[:, -1], []
    for step in range(DECODE_STEPS):
        token = last.argmax(-1)
        pool.append_token(slot, int(token))
        pos = torch.tensor([[len(prompt) + step]])
        last = model(token[:, None], pos, pool.decode_view([slot]))[:, -1]
        steps.append(last[0])
    pool.free_slot(slot)
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


@pytest.mark.parametrize("kind", ["slotted", "paged"])
def test_batched_prefill_and_decode_equal_each_sequence_alone(checkpoint, kind, pool_of, prompt_of):
    _check(checkpoint, pool_of, prompt_of, kind)


@pytest.mark.backend
def test_batched_decode_on_backend_equals_alone(
    checkpoints, attention_backend, ops_for, pool_of, prompt_of
):
    # Gemma 3 only: GQA, both layer kinds and soft-capping in one model.
    _check(checkpoints["gemma3"], pool_of, prompt_of, "paged", ops_for(attention_backend))
