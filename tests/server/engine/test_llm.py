"""The offline ``LLM`` API: vLLM-shaped inputs and results, in prompt order."""

from __future__ import annotations

import pytest

from paged_server.entrypoints.llm import LLM
from paged_server.sampling_params import SamplingParams


@pytest.fixture
def llm(tiny_loaded) -> LLM:
    return LLM(loaded=tiny_loaded, max_batch_size=4, max_model_len=128, block_size=4, max_queue_len=3)


def test_generate_text_prompts_in_order(llm, make_engine, run_engine) -> None:
    prompts = ["Hello world", "The quick brown fox", "def main():", "import os", "x = 1"]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    results = llm.generate(prompts, params, use_tqdm=False)  # 5 prompts, queue of 3
    tokenizer = llm.get_tokenizer()
    assert [r.prompt for r in results] == prompts
    ref = run_engine(make_engine(), [(p, p, params) for p in prompts])
    for prompt, result in zip(prompts, results, strict=True):
        assert result.prompt_token_ids == tokenizer.encode(prompt)
        (choice,) = result.outputs
        assert choice.token_ids == ref.tokens(prompt)
        assert choice.text == ref.choices[(prompt, 0)].text
        assert choice.finish_reason == "length" and len(choice.logprobs) == 6
    assert llm.engine.audit() == []


def test_token_id_prompts_per_prompt_params_and_n(llm) -> None:
    params = [
        SamplingParams(max_tokens=3, temperature=0.0),
        SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=1, ignore_eos=True),
    ]
    results = llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9]], sampling_params=params)
    assert results[0].prompt is None and results[0].prompt_token_ids == [5, 6, 7]
    assert len(results[1].outputs) == 2
    assert [len(c.token_ids) for c in results[1].outputs] == [5, 5]
    assert results[1].outputs[0].logprobs is None


def test_invalid_params_fail_only_that_prompt(llm) -> None:
    results = llm.generate(
        ["good", "bad"],
        [SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(top_p=7.0)],
        use_tqdm=False,
    )
    assert results[0].outputs[0].finish_reason == "length"
    assert results[1].outputs[0].finish_reason == "error"
    assert (results[1].outputs[0].error or "").startswith("top_p")


@pytest.mark.timeout(60)
def test_n_above_max_batch_size_fails_that_prompt_instead_of_hanging(llm) -> None:
    """All n choices run at once, so n=5 with max_batch_size=4 could never start;
    before the check it waited forever and blocked the prompt behind it."""
    results = llm.generate(
        ["too many choices", "after it"],
        [SamplingParams(n=5, max_tokens=2), SamplingParams(max_tokens=2, ignore_eos=True)],
        use_tqdm=False,
    )
    assert [c.finish_reason for c in results[0].outputs] == ["error"] * 5
    assert "n: must be <= 4 (max_batch_size), got 5" in (results[0].outputs[0].error or "")
    assert results[1].outputs[0].finish_reason == "length"
    assert llm.engine.audit() == []


def test_input_mistakes_are_clear(llm) -> None:
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()] * 3)
    with pytest.raises(ValueError, match="not both"):
        llm.generate(["a"], prompt_token_ids=[[1]])


def test_default_model_end_to_end(tmp_path, monkeypatch) -> None:
    """No model given: the embedded default model is built and served."""
    from paged_server.default_model import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    llm = LLM(max_batch_size=2, max_model_len=64, max_num_batched_tokens=64)
    assert llm.engine.config.model is None
    (result,) = llm.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(result.outputs[0].token_ids) == 4 and result.outputs[0].text
    assert (tmp_path / "default-model-v1" / "config.json").is_file()
