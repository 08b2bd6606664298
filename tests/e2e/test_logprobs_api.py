"""Logprobs, echo, logit_bias and min_tokens through the real ``openai``
client against the real server, streamed and not; echoed prompt logprobs
against transformers on the same checkpoint (what a loglikelihood
evaluation reads)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from paged_server.default_model import ensure_default_model

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32).eval()


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)


def tokenize(http: httpx.Client, text: str) -> list[int]:
    resp = http.post("/tokenize", json={"prompt": text})
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_scores_the_prompt_like_transformers(client, http, hf_model, max_tokens) -> None:
    ids = tokenize(http, PROMPT)
    comp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, echo=True,
                                     logprobs=1, temperature=0)
    choice = comp.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(ids) + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    hf = hf_logprobs(hf_model, ids)
    want = [hf[p - 1, ids[p]].item() for p in range(1, len(ids))]
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=1e-4)
    assert "".join(lp.tokens or []) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    # Each dict: the token itself plus its best alternative.
    for p in range(1, len(ids)):
        top = lp.top_logprobs[p]
        assert lp.tokens[p] in top and 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(hf[p - 1].max().item(), abs=1e-4)
    assert comp.usage is not None and comp.usage.completion_tokens == max_tokens


def test_echo_streamed_equals_not_streamed(client) -> None:
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=4, echo=True, logprobs=2, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    text, tokens, values = "", [], []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens or []
                values += c.logprobs.token_logprobs or []
    assert text == whole.text
    assert whole.logprobs is not None
    assert tokens == whole.logprobs.tokens
    assert values == pytest.approx(whole.logprobs.token_logprobs)


def test_echo_of_token_prompts_and_n(client, http) -> None:
    ids = tokenize(http, PROMPT)
    comp = client.completions.create(model="tiny", prompt=[ids, ids[:5]], max_tokens=2, n=2,
                                     echo=True, temperature=0, extra_body={"ignore_eos": True})
    assert len(comp.choices) == 4
    for choice in comp.choices:
        prompt_ids = ids if choice.index < 2 else ids[:5]
        prefix = http.post("/detokenize", json={"tokens": prompt_ids}).json()["prompt"]
        assert choice.text.startswith(prefix) and len(choice.text) > len(prefix)
        assert choice.logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_completion_top_logprobs(client, stream) -> None:
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=5, logprobs=3, temperature=0,
              extra_body={"ignore_eos": True})
    if stream:
        tops, values = [], []
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                if c.logprobs is not None:
                    tops += c.logprobs.top_logprobs or []
                    values += c.logprobs.token_logprobs or []
    else:
        lp = client.completions.create(**kw).choices[0].logprobs
        assert lp is not None
        tops, values = lp.top_logprobs, lp.token_logprobs
    assert len(tops) == len(values) == 5
    for top, value in zip(tops, values, strict=True):
        assert 3 <= len(top) <= 4  # three alternatives, plus the token if not among them
        assert value == pytest.approx(max(top.values()))  # greedy: the token is the best


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs(client, stream) -> None:
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
              logprobs=True, top_logprobs=2, temperature=0, extra_body={"ignore_eos": True})
    if stream:
        content = []
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                if c.logprobs is not None and c.logprobs.content:
                    content += c.logprobs.content
    else:
        logprobs = client.chat.completions.create(**kw).choices[0].logprobs
        assert logprobs is not None and logprobs.content is not None
        content = logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())


# A grammar forces text whose characters the tiny tokenizer splits into byte tokens.
NON_ASCII = "日本語 ü"
FORCED = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"const": NON_ASCII}}}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprob_bytes_rebuild_the_text(client, stream) -> None:
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=30,
              logprobs=True, top_logprobs=2, seed=0, response_format=FORCED)
    if stream:
        text, content = "", []
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                text += c.delta.content or ""
                content += c.logprobs.content if c.logprobs and c.logprobs.content else []
    else:
        choice = client.chat.completions.create(**kw).choices[0]
        text, content = choice.message.content, choice.logprobs.content
    assert text == f'"{NON_ASCII}"'
    assert len(content) > len(text)  # some tokens are parts of a character
    assert bytes(b for entry in content for b in entry.bytes) == text.encode()
    for entry in content:
        for top in entry.top_logprobs:
            assert top.bytes and (top.token == "\ufffd" or bytes(top.bytes) == top.token.encode())


@pytest.mark.parametrize("stream", [False, True])
def test_completion_text_offsets_stay_in_the_text(client, stream) -> None:
    kw = dict(model="tiny", prompt="Say:", max_tokens=30, logprobs=1, seed=0, echo=True,
              extra_body={"response_format": FORCED})
    if stream:
        text, offsets = "", []
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                text += c.text
                offsets += c.logprobs.text_offset if c.logprobs else []
    else:
        choice = client.completions.create(**kw).choices[0]
        text, offsets = choice.text, choice.logprobs.text_offset
    assert text == f'Say:"{NON_ASCII}"'
    # each token starts inside the text, at the character its first byte belongs to
    assert offsets == sorted(offsets) and offsets[-1] == len(text) - 1  # the closing quote


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_forces_a_token(client, http, stream) -> None:
    token = tokenize(http, " dog")[0]
    piece = http.post("/detokenize", json={"tokens": [token]}).json()["prompt"]
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
              logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    if stream:
        text = "".join(c.text for chunk in client.completions.create(stream=True, **kw)
                       for c in chunk.choices)
    else:
        text = client.completions.create(**kw).choices[0].text
    assert text == piece * 3
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0,
        logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == piece * 2


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_off_eos(client, http, stream) -> None:
    eos = http.post("/tokenize", json={"prompt": "<|endoftext|>", "add_special_tokens": False}
                    ).json()["tokens"]
    assert len(eos) == 1
    # Bias EOS up so it would come first; min_tokens keeps it out for 4 tokens.
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
              logit_bias={str(eos[0]): 100}, extra_body={"min_tokens": 4})
    if stream:
        finish, usage = None, None
        for chunk in client.completions.create(stream=True, stream_options={"include_usage": True},
                                               **kw):
            finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
            usage = chunk.usage or usage
    else:
        comp = client.completions.create(**kw)
        finish, usage = comp.choices[0].finish_reason, comp.usage
    assert finish == "stop" and usage is not None and usage.completion_tokens == 5


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias"),
        ({"prompt": "x", "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
    ],
)
def test_bad_values_are_400s_naming_the_field(client, body, param) -> None:
    extra = {k: v for k, v in body.items() if k != "prompt"}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", extra_body=extra)
    assert err.value.param == param  # type: ignore[attr-defined]


def test_chat_top_logprobs_needs_logprobs(client) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       top_logprobs=2)
    assert err.value.param == "top_logprobs"  # type: ignore[attr-defined]


def test_tokenize_detokenize_version(http) -> None:
    body = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    assert "".join(body["token_strs"]) == PROMPT
    assert http.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": PROMPT}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200 and chat.json()["count"] > 1
    assert http.post("/tokenize", json={}).json()["error"]["param"] == "prompt"
    bad = http.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    version = http.get("/version")
    assert version.status_code == 200 and isinstance(version.json()["version"], str)


def test_beam_search_logprobs_bias_and_length_penalty_over_http(http) -> None:
    """Beam search returned only the chosen token per ``logprobs`` entry and
    ignored ``logit_bias``; ``length_penalty: 1024`` overflowed in the step."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "use_beam_search": True,
            "best_of": 2, "ignore_eos": True, "logprobs": 5}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    lp = resp.json()["choices"][0]["logprobs"]
    assert len(lp["top_logprobs"]) == 4
    for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):
        assert len(top) >= 5 and token in top
    favoured = tokenize(http, PROMPT)[2]
    piece = http.post("/detokenize", json={"tokens": [favoured]}).json()["prompt"]
    biased = http.post("/v1/completions", json={**body, "logit_bias": {str(favoured): 100}})
    assert biased.status_code == 200, biased.text
    assert biased.json()["choices"][0]["text"] == piece * 4
    refused = http.post("/v1/completions", json={**body, "length_penalty": 1024})
    assert refused.status_code == 400
    assert "length_penalty" in refused.json()["error"]["message"]
