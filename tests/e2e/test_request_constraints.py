"""Token constraints over HTTP (issue 53): a long ``bad_words`` list is set
up off the engine thread, so a neighbour's stream goes on meanwhile, and
past ``MAX_BAD_WORDS`` it is a 400; constraints that together forbid every
token are a 400 at submission, and never yield a forbidden token."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from paged_server.entrypoints.openai.server import ServerThread
from paged_server.sampling_params import MAX_BAD_WORDS

pytestmark = pytest.mark.e2e

PROMPT = "Once upon a time"


def _stream_times(http: httpx.Client, started: threading.Event, times: list[float]) -> None:
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
                started.set()


def test_many_bad_words_do_not_stall_a_neighbours_stream(http: httpx.Client) -> None:
    times: list[float] = []
    started = threading.Event()
    neighbour = threading.Thread(target=_stream_times, args=(http, started, times))
    neighbour.start()
    assert started.wait(60)
    words = [f"w{i}x" for i in range(MAX_BAD_WORDS)]
    sent = time.monotonic()
    big = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "bad_words": words})
    setup = time.monotonic() - sent
    neighbour.join(120)
    assert big.status_code == 200, big.text
    assert len(times) == 200
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # Built on the engine thread, the list held every stream for the whole
    # set-up (10.7 s here at 10,000 words); off it, the neighbour's tokens
    # keep coming while the big request is prepared.
    assert max(gaps) < max(0.5 * setup, 1.0), (max(gaps), setup)


def test_too_many_bad_words_are_a_400_naming_the_limit(http: httpx.Client) -> None:
    words = ["w"] * (MAX_BAD_WORDS + 1)
    resp = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "bad_words": words})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "bad_words" and str(MAX_BAD_WORDS) in err["message"], err


def _token(server: ServerThread, text: str) -> int:
    ids = server.engine.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, ids
    return ids[0]


def test_constraints_that_forbid_every_token_are_400s(server: ServerThread, http: httpx.Client) -> None:
    eos = sorted(server.engine.eos_token_ids)
    hash_id = _token(server, "#")
    cases: list[dict[str, Any]] = [
        {"allowed_token_ids": eos, "min_tokens": 3},  # only stop tokens, masked by min_tokens
        {"allowed_token_ids": [hash_id], "bad_words": ["#"]},  # the one allowed token is banned
        {"allowed_token_ids": [hash_id], "guided_choice": ["yes", "no"]},  # cannot start a choice
    ]
    for case in cases:
        resp = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, **case})
        assert resp.status_code == 400, (case, resp.text)
        err = resp.json()["error"]
        assert err["param"] == "allowed_token_ids" and "no token can be generated" in err["message"], err
    # still honoured when a token is left
    ok = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                            "allowed_token_ids": [*eos, hash_id], "min_tokens": 3,
                                            "logprobs": 0, "return_tokens_as_token_ids": True})
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["logprobs"]["tokens"] == [f"token_id:{hash_id}"] * 3


def test_beam_search_never_reports_an_impossible_output(http: httpx.Client, server: ServerThread) -> None:
    eos = sorted(server.engine.eos_token_ids)
    body = {"prompt": PROMPT, "max_tokens": 3, "use_beam_search": True, "n": 2, "temperature": 0,
            "logprobs": 0}
    # Only EOS allowed: one output exists ([EOS]); a second choice used to
    # come back at a log-probability of -1e9.
    resp = http.post("/v1/completions", json={**body, "allowed_token_ids": eos[:1]})
    assert resp.status_code != 200, json.dumps(resp.json())[:300]
    assert "only 1 output(s) can be generated" in resp.json()["error"]["message"]
    two = http.post("/v1/completions", json={**body, "allowed_token_ids": [eos[0], _token(server, "#")]})
    assert two.status_code == 200, two.text
    for choice in two.json()["choices"]:
        assert all(lp > -1e4 for lp in choice["logprobs"]["token_logprobs"]), choice


def test_float32_underflowing_parameters_keep_to_the_grammar(server: ServerThread, http: httpx.Client) -> None:
    """schemathesis's body (issue 53 follow-up): 5e-324 is a legal
    repetition_penalty and top_p for vLLM, and float32 made the penalty 0;
    the grammar's masked logits became NaN and a 500 said 'structured
    output: token 4095 rejected'. The empty regex allows only EOS."""
    # the bytes as sent (json.dumps writes 5e-324 too; this keeps the test from depending on it)
    raw = (f'{{"prompt": "{PROMPT}", "max_tokens": 4, "repetition_penalty": 5e-324, '
           '"top_p": 5e-324, "guided_regex": ""}')
    resp = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    (choice,) = resp.json()["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("", "stop"), choice
    for extra in ({"temperature": 0}, {"top_p": 1}):  # greedy (took the NaN's index) and plain sampling
        body = {"prompt": PROMPT, "max_tokens": 4, "repetition_penalty": 5e-324, "guided_regex": "", **extra}
        resp = http.post("/v1/completions", json=body)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "", (extra, resp.text)
