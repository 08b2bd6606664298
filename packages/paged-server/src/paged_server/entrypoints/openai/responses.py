"""OpenAI response bodies and stream chunks, built from engine outputs.

Pure formatting: one `ResponseFormat` per HTTP request knows its id, model
name and creation time, and turns choices, token ids and log-probabilities
into the JSON OpenAI clients parse (``text_completion``, ``chat.completion``
and their streaming ``chunk`` forms).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from paged_server.entrypoints.openai.tool_calls import parse_tool_calls


@dataclass(slots=True)
class CollectedChoice:
    """Everything one choice produced, for the non-streaming body."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_generated: int = 0

    def add(self, out: Any) -> None:
        """Append one ``RequestOutput`` delta."""
        self.text.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            self.logprobs.extend(out.new_logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason
            self.error = out.error
            self.num_generated = out.num_generated_tokens


def finite(logprob: float) -> float:
    """JSON has no -Infinity; OpenAI reports impossible tokens as -9999.0."""
    return logprob if math.isfinite(logprob) else -9999.0


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from
    the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ResponseFormat:
    """The bodies of one request (completion or chat, streaming or not)."""

    def __init__(self, request_id: str, model: str, tokenizer: Any, *, include_usage: bool = False) -> None:
        self.request_id = request_id
        self.model = model
        self.tokenizer = tokenizer
        self.include_usage = include_usage  # streaming: every chunk carries "usage": null
        self.tool_call_parser: str | None = None  # set when the request may call tools
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    # ---------------------------------------------------------------- chunks
    def completion_chunk(self, index: int, text: str, finish: str | None, logprobs: Any = None) -> dict[str, Any]:
        body = self._envelope(
            "text_completion",
            [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        )
        if self.include_usage:
            body["usage"] = None
        return body

    def chat_chunk(self, index: int, delta: dict[str, Any], finish: str | None, logprobs: Any = None) -> dict[str, Any]:
        body = self._envelope(
            "chat.completion.chunk",
            [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        )
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(
        self, obj: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> dict[str, Any]:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        return {
            **self._envelope(obj, []),
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
        }

    # ---------------------------------------------------------------- bodies
    def completion_body(
        self, choices: list[CollectedChoice], prompt_tokens: int, cached_tokens: int = 0
    ) -> dict[str, Any]:
        return {
            **self._envelope("text_completion", [
                {
                    "index": i,
                    "text": "".join(c.text),
                    "logprobs": self.completion_logprobs(c.token_ids, c.logprobs, 0) if c.logprobs else None,
                    "finish_reason": c.finish_reason,
                }
                for i, c in enumerate(choices)
            ]),
            "usage": usage(prompt_tokens, _generated(choices), cached_tokens),
        }

    def chat_body(
        self, choices: list[CollectedChoice], prompt_tokens: int, cached_tokens: int = 0
    ) -> dict[str, Any]:
        return {
            **self._envelope("chat.completion", [
                {
                    "index": i,
                    **self._chat_message("".join(c.text), c.finish_reason),
                    "logprobs": self.chat_logprobs(c.token_ids, c.logprobs) if c.logprobs else None,
                }
                for i, c in enumerate(choices)
            ]),
            "usage": usage(prompt_tokens, _generated(choices), cached_tokens),
        }

    def _chat_message(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        """``message`` and ``finish_reason`` of one choice; tool calls parsed
        out of the text when the request offered tools."""
        if self.tool_call_parser is None:
            return {"message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        content, calls = parse_tool_calls(self.tool_call_parser, text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.to_dict() for c in calls]
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return {"message": message, "finish_reason": finish_reason}

    # -------------------------------------------------------------- logprobs
    def _token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def completion_logprobs(self, token_ids: list[int], logprobs: list[float], start_offset: int) -> dict[str, Any]:
        """Completions' ``logprobs`` object; offsets count from the choice's text start."""
        tokens = [self._token_text(t) for t in token_ids[: len(logprobs)]]
        offsets, pos = [], start_offset
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [finite(lp) for lp in logprobs],
            "top_logprobs": None,
            "text_offset": offsets,
        }

    def chat_logprobs(self, token_ids: list[int], logprobs: list[float]) -> dict[str, Any]:
        """Chat's ``logprobs.content`` list (no top alternatives)."""
        content = []
        for tid, lp in zip(token_ids, logprobs, strict=False):
            tok = self._token_text(tid)
            content.append({"token": tok, "logprob": finite(lp), "bytes": list(tok.encode()), "top_logprobs": []})
        return {"content": content}


def _generated(choices: list[CollectedChoice]) -> int:
    return sum(c.num_generated or len(c.token_ids) for c in choices)
