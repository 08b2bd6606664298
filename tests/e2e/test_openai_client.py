"""The official openai client against the real server and tiny model."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from .conftest import MAX_SEQ_LEN, MODEL

pytestmark = pytest.mark.e2e

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == MAX_SEQ_LEN


def test_completion_stream_equals_non_stream_greedy(client: openai.OpenAI, server: Any) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == 24
    assert full.usage.prompt_tokens == len(server.engine.tokenizer.encode(PROMPT))
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24

    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_equals_non_stream_greedy(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    msg = full.choices[0].message
    assert msg.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == msg.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_chat_prompt_uses_the_checkpoint_template(client: openai.OpenAI, server: Any) -> None:
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    expected = server.engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert full.usage.prompt_tokens == len(expected)


def test_token_id_prompt_matches_text_prompt(client: openai.OpenAI, server: Any) -> None:
    ids = server.engine.tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_seed_makes_sampling_reproducible_and_n_gives_choices(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                  top_p=0.9, n=3, seed=1234, extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 36


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    prompt = "def main():"  # the tiny random model continues this in ASCII
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    # the 2-character ASCII stop whose first occurrence comes latest
    candidates = [
        (greedy[p:p + 2], p) for p in range(1, len(greedy) - 1)
        if greedy[p:p + 2].isascii() and greedy[p:p + 2].strip() and greedy.find(greedy[p:p + 2]) == p
    ]
    assert candidates, f"no usable stop string in {greedy!r}"
    stop, pos = max(candidates, key=lambda c: c[1])
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == greedy[:pos]


def test_logprobs_cover_every_generated_token(client: openai.OpenAI) -> None:
    comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                     logprobs=0, extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and len(lp.tokens) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                          logprobs=True, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(t.logprob <= 0 for t in content)


def test_max_tokens_is_respected_and_chat_default_fills_context(client: openai.OpenAI) -> None:
    comp = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert comp.usage.completion_tokens == 3
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"ignore_eos": True})
    assert chat.usage.total_tokens == MAX_SEQ_LEN
    assert chat.choices[0].finish_reason == "length"


def test_async_client_streams(server: Any) -> None:
    import asyncio

    async def main() -> str:
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        try:
            stream = await ac.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                                 temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream])
        finally:
            await ac.close()

    assert isinstance(asyncio.run(main()), str)


def test_completion_beam_search_returns_the_best_beams(client: openai.OpenAI, server: Any) -> None:
    """vLLM's ``use_beam_search`` + ``best_of``: the ``n`` best of ``best_of``
    beams, the same beams ``LLM.beam_search`` finds offline."""
    from paged_server import LLM, BeamSearchParams

    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, n=2,
                                     extra_body={"use_beam_search": True, "best_of": 4})
    offline = LLM(loaded=server.engine.loaded, device="cpu", attention_backend="ref",
                  max_model_len=MAX_SEQ_LEN)
    beams = offline.beam_search([PROMPT], BeamSearchParams(beam_width=4, max_tokens=10))
    best = beams[0].sequences[:2]
    assert [c.text for c in resp.choices] == [b.text for b in best]
    assert [c.index for c in resp.choices] == [0, 1]
    prompt_len = resp.usage.prompt_tokens
    assert resp.usage.completion_tokens == sum(len(b.tokens) - prompt_len for b in best)
    with pytest.raises(openai.BadRequestError, match="send stream=false"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=True,
                                  extra_body={"use_beam_search": True})
