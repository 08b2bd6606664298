"""``usage.prompt_tokens_details.cached_tokens``: prompt tokens served from
the prefix cache, read back by the official openai client."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from .conftest import MODEL

pytestmark = pytest.mark.e2e


def long_prompt(tag: str) -> str:
    return f"{tag}: " + " ".join(f"word{i} of {tag}" for i in range(30))


def expected_hits(server: Any, prompt_tokens: int) -> int:
    """Every full block before the one holding the last prompt token."""
    block_size = server.engine.config.block_size
    return (prompt_tokens - 1) // block_size * block_size


def test_completion_reports_cached_prompt_tokens(client: openai.OpenAI, server: Any) -> None:
    prompt = long_prompt("completion")
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    hits = expected_hits(server, second.usage.prompt_tokens)
    assert hits > 0
    assert second.usage.prompt_tokens_details.cached_tokens == hits


def test_streamed_usage_chunk_reports_cached_tokens(client: openai.OpenAI, server: Any) -> None:
    prompt = long_prompt("stream")
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, n=2,
                                       stream=True, stream_options={"include_usage": True})
    usage = list(stream)[-1].usage
    assert usage is not None
    assert usage.prompt_tokens_details.cached_tokens == expected_hits(server, usage.prompt_tokens)


def test_chat_reports_cached_tokens(client: openai.OpenAI, server: Any) -> None:
    messages = [{"role": "user", "content": long_prompt("chat")}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                            stream=True, stream_options={"include_usage": True})
    usage = list(stream)[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == expected_hits(server, usage.prompt_tokens)
