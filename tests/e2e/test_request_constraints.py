"""Token constraints over HTTP (issue 53): a long ``bad_words`` list is set
up off the engine thread, so a neighbour's stream goes on meanwhile, and
past ``MAX_BAD_WORDS`` it is a 400."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

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
