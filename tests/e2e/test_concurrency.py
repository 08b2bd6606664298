"""64 streaming clients at once on the paged backend: every stream completes
and matches what the same prompt gives alone."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from .conftest import MODEL, wait_idle

pytestmark = pytest.mark.e2e

PROMPTS = [f"Request {i}: the weather today is" + " very" * i for i in range(8)]
MAX_TOKENS = 8


def test_64_concurrent_streams_complete_correctly(server: Any, client: openai.OpenAI) -> None:
    # What each prompt gives on its own (greedy), one at a time.
    alone = {
        p: client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
        for p in PROMPTS
    }
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(64)]

    async def one(ac: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None, int]:
        stream = await ac.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        text, finish, tokens = "", None, 0
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return text, finish, tokens

    async def main() -> list[tuple[str, str | None, int]]:
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(ac, p) for p in jobs))
        finally:
            await ac.close()

    # idle first: the last "alone" request's tokens may still be being counted
    before = wait_idle(server)["generation_tokens_total"]
    results = asyncio.run(main())
    assert len(results) == 64
    for prompt, (text, finish, tokens) in zip(jobs, results, strict=True):
        assert finish == "length" and tokens == MAX_TOKENS
        assert text == alone[prompt]
    after = wait_idle(server)
    assert after["generation_tokens_total"] - before == 64 * MAX_TOKENS
    assert after["kv_cache_usage_perc"] == 0.0
    assert server.engine.audit() == []
