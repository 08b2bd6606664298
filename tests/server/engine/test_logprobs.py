"""Prompt and sampled-token logprobs against transformers on the same
checkpoint: prompt logprobs through chunked prefill, after a prefix-cache
warm-up (scored tokens must be computed, not read from the cache) and
through preemption; top-N alternatives; offline shapes as vLLM."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from paged_server.entrypoints.llm import LLM
from paged_server.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]``: row p is the distribution after tokens 0..p."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), -1)


def check_prompt_logprobs(result, hf: torch.Tensor, num_top: int) -> None:
    ids = result.prompt_token_ids
    scored = result.prompt_logprobs
    assert scored is not None and len(scored) == len(ids) and scored[0] is None
    for p in range(1, len(ids)):
        entry = scored[p]
        assert entry is not None and ids[p] in entry
        assert entry[ids[p]] == pytest.approx(hf[p - 1, ids[p]].item(), abs=1e-4)
        top = hf[p - 1].topk(num_top).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= num_top + 1


@pytest.mark.parametrize("budget", [7, 256])  # 7: every prompt in several chunks
def test_prompt_logprobs_equal_transformers(tiny_loaded, hf_model, prompt_of, budget) -> None:
    llm = LLM(loaded=tiny_loaded, max_batch_size=4, max_model_len=128, block_size=4, max_num_batched_tokens=budget,
              device="cpu", attention_backend="ref")
    prompts = [prompt_of(length, seed) for length, seed in [(23, 1), (9, 2), (2, 3)]]
    plain = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(prompt_token_ids=prompts, sampling_params=plain, use_tqdm=False)  # warm the cache
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    results = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for result in results:
        check_prompt_logprobs(result, hf_logprobs(hf_model, result.prompt_token_ids), 3)
    assert llm.engine.audit() == []


def test_prompt_logprobs_survive_preemption(tiny_loaded, hf_model, prompt_of) -> None:
    # 12 blocks of 4 tokens: two 20-token prompts growing by 16 cannot both fit.
    llm = LLM(loaded=tiny_loaded, max_batch_size=4, max_model_len=64, block_size=4, num_gpu_blocks=12,
              max_num_batched_tokens=8, device="cpu", attention_backend="ref")
    prompts = [prompt_of(20, 4), prompt_of(20, 5)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    results = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert llm.engine.metrics()["num_preemptions_total"] > 0
    for result in results:
        assert len(result.outputs[0].token_ids) == 16
        check_prompt_logprobs(result, hf_logprobs(hf_model, result.prompt_token_ids), 0)


def test_sampled_top_logprobs_equal_transformers(tiny_loaded, hf_model, prompt_of) -> None:
    llm = LLM(loaded=tiny_loaded, max_batch_size=4, max_model_len=128, block_size=4, device="cpu",
              attention_backend="ref")
    prompt = prompt_of(11, 6)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=4, n=2)
    (result,) = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    assert result.prompt_logprobs is None  # not asked for
    for choice in result.outputs:
        assert choice.logprobs is not None and choice.top_logprobs is not None
        hf = hf_logprobs(hf_model, prompt + choice.token_ids)
        for k, (token, lp, entry) in enumerate(
            zip(choice.token_ids, choice.logprobs, choice.top_logprobs, strict=True)
        ):
            row = hf[len(prompt) - 1 + k]
            assert lp == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[token] == lp
            assert set(row.topk(4).indices.tolist()) <= set(entry)


def test_chat_applies_the_template() -> None:
    llm = LLM(max_batch_size=4, max_model_len=128, device="cpu", attention_backend="ref",
              dtype="float32")  # the embedded default model: it has a chat template
    messages = [{"role": "user", "content": "Hello there"}]
    want = list(llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True,
                                                        tokenize=True))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    (one,) = llm.chat(messages, params, use_tqdm=False)
    assert one.prompt_token_ids == want and len(one.outputs[0].token_ids) == 3
    both = llm.chat([messages, messages + [{"role": "assistant", "content": "Hi"}]], params)
    assert both[0].outputs[0].token_ids == one.outputs[0].token_ids
    assert len(both[1].prompt_token_ids) > len(want)
