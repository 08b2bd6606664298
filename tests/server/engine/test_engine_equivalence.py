"""Greedy outputs are a property of the model, not of the cache: the same
tokens (and near-identical logprobs) from the contiguous pool, the paged pool,
with and without prefix caching, with small prefill chunks and under forced
preemption, and the same tokens as transformers' own greedy generate."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM


def workload(prompt_of, greedy, count: int = 6, max_tokens: int = 10):
    """Prompts of mixed lengths (several blocks of 4, some partial) sharing a prefix."""
    shared = prompt_of(9, 100)
    requests = []
    for i in range(count):
        prompt = (shared if i % 2 else []) + prompt_of(3 + 5 * i, i)
        requests.append((f"r{i}", prompt, greedy(max_tokens, logprobs=0)))
    return requests


def assert_same_outputs(run, reference, requests) -> None:
    for request_id, _, _ in requests:
        got, want = run.choices[(request_id, 0)], reference.choices[(request_id, 0)]
        assert got.token_ids == want.token_ids, request_id
        assert got.finish_reason == want.finish_reason == "length"
        assert got.error is None
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


@pytest.fixture
def reference(make_engine, run_engine, prompt_of, greedy):
    """Contiguous pool, no chunking: the plainest path."""
    requests = workload(prompt_of, greedy)
    engine = make_engine(kv_cache_backend="contiguous", max_batch_size=4)
    return requests, run_engine(engine, requests)


@pytest.mark.backend
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_paged_matches_contiguous(
    reference, make_engine, run_engine, attention_backend, prefix_caching
) -> None:
    requests, ref = reference
    engine = make_engine(
        kv_cache_backend="paged",
        max_batch_size=4,
        attention_backend=attention_backend,
        enable_prefix_caching=prefix_caching,
    )
    assert_same_outputs(run_engine(engine, requests), ref, requests)
    assert engine.audit() == []


@pytest.mark.backend
def test_forced_preemption_matches_unpressured_run(
    make_engine, run_engine, prompt_of, greedy, attention_backend
) -> None:
    """Short prompts, long outputs: admission sees room, growth runs out of
    blocks, the newest sequences are preempted and recomputed; the tokens
    are the same as with a roomy pool and nothing fails."""
    requests = [(f"g{i}", prompt_of(4 + i, 50 + i), greedy(16, logprobs=0)) for i in range(3)]
    roomy = run_engine(make_engine(), requests)  # reference attention, plenty of blocks
    engine = make_engine(attention_backend=attention_backend, num_gpu_blocks=7)  # 28 tokens
    run = run_engine(engine, requests)
    assert_same_outputs(run, roomy, requests)
    assert engine.metrics()["num_preemptions_total"] > 0
    assert engine.audit() == []


def test_chunked_prefill_under_block_pressure_matches(reference, make_engine, run_engine) -> None:
    requests, ref = reference
    engine = make_engine(
        max_batch_size=4,
        max_num_batched_tokens=8,  # prompts up to 37 tokens: several chunks each
        num_gpu_blocks=14,  # 56 tokens: the longest sequence alone needs 12 blocks
    )
    assert_same_outputs(run_engine(engine, requests), ref, requests)
    assert engine.audit() == []


@pytest.mark.parametrize("chunk", [5, 16])
def test_small_chunks_without_pressure_match(reference, make_engine, run_engine, chunk) -> None:
    requests, ref = reference
    engine = make_engine(max_batch_size=4, max_num_batched_tokens=max(chunk, 4))
    assert_same_outputs(run_engine(engine, requests), ref, requests)


def test_unchunked_prefill_matches(reference, make_engine, run_engine) -> None:
    requests, ref = reference
    engine = make_engine(max_batch_size=4, enable_chunked_prefill=False)
    assert_same_outputs(run_engine(engine, requests), ref, requests)


def test_contiguous_preempts_when_slots_are_memory_limited(
    reference, make_engine, run_engine, tiny_loaded
) -> None:
    """Contiguous rows run out of positions only at max_model_len, so here the
    pressure is fewer seq_ids than max_batch_size: requests wait, none fail."""
    requests, ref = reference
    c = tiny_loaded.config
    row_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * 128
    engine = make_engine(kv_cache_backend="contiguous", kv_cache_memory_bytes=2 * row_bytes)
    assert engine.capacity.num_rows == 2
    assert_same_outputs(run_engine(engine, requests), ref, requests)


def test_greedy_matches_transformers_generate(
    tiny_model_dir, make_engine, run_engine, prompt_of, greedy
) -> None:
    """Tokens and logprobs of both prompts, batched together, equal
    transformers' greedy generate run on each prompt alone."""
    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    prompts = [prompt_of(7, 1), prompt_of(22, 2)]
    engine = make_engine(max_batch_size=2)
    run = run_engine(
        engine, [(f"p{i}", p, greedy(10, logprobs=0)) for i, p in enumerate(prompts)]
    )
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=10,
                do_sample=False,
                eos_token_id=None,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, len(prompt) :].tolist()
        assert run.tokens(f"p{i}") == tokens
        logprobs = [
            torch.log_softmax(step[0].float(), -1)[tok].item()
            for step, tok in zip(out.logits, tokens, strict=True)
        ]
        assert run.choices[(f"p{i}", 0)].logprobs == pytest.approx(logprobs, abs=1e-4)


def test_the_c_kernels_backend_matches_contiguous(reference, make_engine, run_engine) -> None:
    """``attention_backend="cpu"`` (the C kernels, in an eager engine too): the
    same tokens, and logprobs as close as the reference backend's."""
    requests, ref = reference
    engine = make_engine(kv_cache_backend="paged", max_batch_size=4, attention_backend="cpu")
    assert engine.worker.tensors.backend.name == "cpu"
    assert_same_outputs(run_engine(engine, requests), ref, requests)
    assert engine.audit() == []
