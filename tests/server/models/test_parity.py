"""Our models against transformers on the same tiny random checkpoints:
prefill logits, and 32 greedy tokens through every cache backend."""

from __future__ import annotations

import pytest
import torch

PROMPT_LEN = 13  # longer than Gemma's window of 8, not a multiple of the block size
STEPS = 32
LOGIT_ATOL = 1e-4  # float32; observed differences are ~1e-6


@torch.no_grad()
def test_prefill_logits_match_transformers(any_checkpoint, prompt_of):
    prompt = torch.tensor([prompt_of(PROMPT_LEN, 1), prompt_of(PROMPT_LEN, 2)])
    positions = torch.arange(PROMPT_LEN).expand(2, -1)
    ours = any_checkpoint.loaded.model(prompt, positions)
    theirs = any_checkpoint.hf_model(prompt).logits
    assert ours.dtype == torch.float32
    assert ours.shape == (2, PROMPT_LEN, any_checkpoint.loaded.config.vocab_size)
    torch.testing.assert_close(ours, theirs, atol=LOGIT_ATOL, rtol=0)


@torch.no_grad()
def test_greedy_without_cache_matches_generate(any_checkpoint, prompt_of, hf_greedy_of):
    prompt = prompt_of(PROMPT_LEN, 3)
    seq = list(prompt)
    for _ in range(STEPS):
        logits = any_checkpoint.loaded.model(torch.tensor([seq]), torch.arange(len(seq))[None])
        seq.append(int(logits[0, -1].argmax()))
    assert seq[PROMPT_LEN:] == hf_greedy_of(any_checkpoint.hf_model, prompt, STEPS)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_greedy_with_ref_pools_matches_generate(
    any_checkpoint, kind, prompt_of, pool_of, greedy_pool, hf_greedy_of
):
    prompt = prompt_of(PROMPT_LEN, 4)
    pool = pool_of(kind, any_checkpoint.loaded)
    tokens, step_logits = greedy_pool(any_checkpoint.loaded.model, pool, prompt, STEPS)
    assert tokens == hf_greedy_of(any_checkpoint.hf_model, prompt, STEPS)
    # Every step's logits, not just the argmax, equal a full forward pass of transformers.
    full = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        expected = any_checkpoint.hf_model(full).logits[0, PROMPT_LEN - 1 :]
    torch.testing.assert_close(torch.stack(step_logits), expected, atol=LOGIT_ATOL, rtol=0)
    assert pool.audit() == []


@pytest.mark.backend
def test_greedy_with_paged_pool_on_backend(
    any_checkpoint, attention_backend, ops_for, prompt_of, pool_of, greedy_pool, hf_greedy_of
):
    prompt = prompt_of(PROMPT_LEN, 5)
    pool = pool_of("paged", any_checkpoint.loaded, ops=ops_for(attention_backend))
    tokens, _ = greedy_pool(any_checkpoint.loaded.model, pool, prompt, STEPS)
    assert tokens == hf_greedy_of(any_checkpoint.hf_model, prompt, STEPS)
