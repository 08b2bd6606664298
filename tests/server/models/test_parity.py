"""Our models (every supported family) against transformers on the same
tiny random checkpoints: prefill logits, 32 greedy tokens through every
cache backend, and the engine's greedy tokens and prompt logprobs."""

from __future__ import annotations

import pytest
import torch

PROMPT_LEN = 13  # longer than Gemma's window of 8, not a multiple of the block size
STEPS = 32
BACKEND_STEPS = 16  # past two windows; the Triton interpreter is slow
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
    tokens, _ = greedy_pool(any_checkpoint.loaded.model, pool, prompt, BACKEND_STEPS)
    assert tokens == hf_greedy_of(any_checkpoint.hf_model, prompt, BACKEND_STEPS)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_engine_greedy_and_prompt_logprobs_match_transformers(
    any_checkpoint, kind, prompt_of, hf_greedy_of
):
    """Through the engine: chunked prefill (8-token steps), two sequences
    batched, the hybrid KV manager where the family has windows."""
    from paged_server import LLM, SamplingParams

    llm = LLM(
        loaded=any_checkpoint.loaded, max_batch_size=2, max_model_len=64, block_size=4,
        max_num_batched_tokens=8, kv_cache_backend=kind, device="cpu", attention_backend="ref",
    )  # fmt: skip
    prompts = [prompt_of(PROMPT_LEN, 6), prompt_of(9, 7)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    results = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert llm.engine.audit() == []
    for prompt, result in zip(prompts, results, strict=True):
        assert result.outputs[0].token_ids == hf_greedy_of(any_checkpoint.hf_model, prompt, 12)
        with torch.no_grad():
            logits = any_checkpoint.hf_model(torch.tensor([prompt])).logits[0]
        expected = torch.log_softmax(logits.float(), -1)
        scored = result.prompt_logprobs
        for p in range(1, len(prompt)):
            assert scored[p][prompt[p]] == pytest.approx(expected[p - 1, prompt[p]].item(), abs=LOGIT_ATOL)
