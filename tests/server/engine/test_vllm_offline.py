"""`paged_server.LLM` takes what `vllm.LLM` takes: its constructor names,
its prompt forms, chat() arguments, max_tokens=None, num_cached_tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from paged_server import LLM, SamplingParams
from paged_server.models import LoadedModel

SMALL = dict(max_model_len=64, max_num_batched_tokens=64, block_size=4, device="cpu",
             attention_backend="ref")
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_loaded: LoadedModel) -> LLM:
    return LLM(loaded=tiny_loaded, max_num_seqs=4, num_gpu_blocks_override=96,
               trust_remote_code=True, **SMALL)


def test_vllm_constructor_names(llm: LLM) -> None:
    assert llm.engine.config.max_batch_size == 4
    assert llm.engine.capacity.num_blocks == 96
    with pytest.raises(TypeError, match="'swap_space': no CPU swap"):
        LLM(swap_space=4)
    with pytest.raises(TypeError, match="'revision': paged-server downloads nothing"):
        LLM(revision="main")


def test_prompt_forms_give_the_same_completion(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("hello there")
    forms = ["hello there", {"prompt": "hello there"}, {"prompt_token_ids": ids}, ids]
    outs = [llm.generate(form, GREEDY, use_tqdm=False) for form in forms]
    assert all(len(o) == 1 for o in outs)
    assert len({tuple(o[0].outputs[0].token_ids) for o in outs}) == 1
    mixed = llm.generate(["hello there", {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == mixed[1].outputs[0].token_ids
    assert mixed[0].finished and mixed[1].prompt_token_ids == ids
    with pytest.raises(ValueError, match="needs 'prompt' or 'prompt_token_ids'"):
        llm.generate({"text": "x"}, GREEDY)


def test_num_cached_tokens_counts_prefix_hits(llm: LLM) -> None:
    prompt = "a long shared prompt that fills several blocks of four tokens"
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens >= 4 and again.num_cached_tokens % 4 == 0


def test_max_tokens_none_runs_to_max_model_len(llm: LLM) -> None:
    out = llm.generate("hi", SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64
    assert out.outputs[0].finish_reason == "length"


def test_chat_arguments_reach_the_template(llm: LLM) -> None:
    template = ("{% for t in tools or [] %}[{{ t.name }}]{% endfor %}{{ flavor }}:"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello th"}]
    out = llm.chat(history, GREEDY, chat_template=template, add_generation_prompt=False,
                   continue_final_message=True, tools=[{"name": "f"}],
                   chat_template_kwargs={"flavor": "mint"}, use_tqdm=False)[0]
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == "[f]mint:<user>hi<assistant>Hello th"
    closed = llm.chat(history, GREEDY, chat_template=template, use_tqdm=False)[0]
    assert llm.get_tokenizer().decode(closed.prompt_token_ids).endswith("Hello th<assistant>")


def test_logprobs_minus_one_is_the_whole_vocabulary_with_max_logprobs_minus_one(
    llm: LLM, tiny_loaded: LoadedModel
) -> None:
    refused = llm.generate("hi", SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)[0]
    assert "logprobs" in (refused.outputs[0].error or "")
    open_llm = LLM(loaded=tiny_loaded, max_logprobs=-1, **SMALL)
    out = open_llm.generate("hi", SamplingParams(max_tokens=2, logprobs=-1), use_tqdm=False)[0]
    tops = out.outputs[0].top_logprobs
    assert tops is not None and all(len(t) == tiny_loaded.config.vocab_size for t in tops)


def test_tokenizer_from_another_directory(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "tok"
    other.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", other)
    (other / "tokenizer_config.json").write_text(json.dumps({"chat_template": "OTHER{{ messages[0].content }}"}))
    llm = LLM(str(tiny_model_dir), tokenizer=str(other), **SMALL)
    out = llm.chat([{"role": "user", "content": "x"}], GREEDY, use_tqdm=False)[0]
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == "OTHERx"


def test_detokenize_false_gives_the_same_tokens_without_text(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = dict(temperature=0.0, max_tokens=6, ignore_eos=True, n=2)
    texted = llm.generate("hello there", SamplingParams(**params), use_tqdm=False)[0]
    stop_at = texted.outputs[0].token_ids[2]
    first = texted.outputs[0].token_ids.index(stop_at)

    def no_decoding(*args: object, **kwargs: object) -> str:
        raise AssertionError("a detokenize=False request was detokenized")

    from paged_server.engine.output.detokenize import IncrementalDetokenizer

    monkeypatch.setattr(IncrementalDetokenizer, "add", no_decoding)
    monkeypatch.setattr(IncrementalDetokenizer, "flush", no_decoding)
    bare = llm.generate("hello there", SamplingParams(**params, detokenize=False), use_tqdm=False)[0]
    assert [c.token_ids for c in bare.outputs] == [c.token_ids for c in texted.outputs]
    assert all(c.text == "" and c.finish_reason == "length" for c in bare.outputs)
    assert all(c.text for c in texted.outputs)  # the model's tokens do have text
    # Stop tokens end it as before: they are checked on ids, not text.
    stopped = llm.generate(
        "hello there",
        SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop_at], detokenize=False),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.token_ids == texted.outputs[0].token_ids[: first + 1] and stopped.finish_reason == "stop"


def test_detokenize_false_refuses_stop_strings() -> None:
    with pytest.raises(ValueError, match="stop: stop strings are only supported when detokenize"):
        SamplingParams(stop=["x"], detokenize=False).validate(64)
    with pytest.raises(ValueError, match="detokenize: must be true or false"):
        SamplingParams(detokenize="no").validate(64)  # type: ignore[arg-type]
