"""The bodies and stream chunks of completions and chat completions, built from engine outputs.

Pure formatting: one `ResponseFormat` per HTTP request knows its id, model
name and creation time, and turns choices, token ids and log-probabilities
into the JSON OpenAI clients parse (``text_completion``, ``chat.completion``
and their streaming ``chunk`` forms). With ``echo``, a completion choice
starts with its prompt (text, tokens and, when asked, the prompt's
logprobs, the first of which is null); with ``max_tokens: 0`` (``echo``
only) the one token the engine generates is dropped.
"""

from __future__ import annotations

import codecs
import functools
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

from paged_server.entrypoints.openai.reasoning import split_reasoning
from paged_server.entrypoints.openai.tool_calls import parse_tool_calls


@dataclass(slots=True)
class CollectedChoice:
    """Everything one choice produced, for the non-streaming body."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_generated: int = 0

    def add(self, out: Any) -> None:
        """Append one ``RequestOutput`` delta."""
        self.text.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            self.logprobs.extend(out.new_logprobs)
        if out.new_top_logprobs:
            self.top_logprobs.extend(out.new_top_logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
            self.error = out.error
            self.num_generated = out.num_generated_tokens


def finite(logprob: float) -> float:
    """JSON has no -Infinity; OpenAI reports impossible tokens as -9999.0."""
    return logprob if math.isfinite(logprob) else -9999.0


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The usage so far that ``continuous_usage_stats`` puts in every chunk
    (vLLM's three counts, without the details of the final usage)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from
    the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(slots=True)
class Echo:
    """What ``echo`` puts before a completion: each prompt's text and ids;
    ``drop_generated`` for ``max_tokens: 0`` (score the prompt only)."""

    texts: list[str]
    token_ids: list[list[int]]
    drop_generated: bool = False


class ResponseFormat:
    """The bodies of one request (completion or chat, streaming or not)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        tokenizer: Any,
        *,
        include_usage: bool = False,
        continuous_usage: bool = False,
        num_top: int | None = None,
        echo: Echo | None = None,
        n: int = 1,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.tokenizer = tokenizer
        self.include_usage = include_usage  # streaming: every chunk carries "usage" (null, or:)
        self.continuous_usage = continuous_usage  # its choice's usage so far
        self.return_token_ids = False  # return_token_ids: token ids beside the text
        self.prompt_token_ids: list[list[int]] = []  # each prompt's, for return_token_ids
        self.prompt_text: str | None = None  # chat return_prompt_text: the rendered prompt
        self.tool_call_parser: str | None = None  # set when the request may call tools
        self.reasoning_parser: str | None = None  # --reasoning-parser (chat only)
        self.include_reasoning = True  # the request's include_reasoning
        self.role = "assistant"  # --response-role
        self.chat_echo: str | None = None  # chat echo: the last message, the reply's start
        self.tokens_as_ids = False  # return_tokens_as_token_ids
        self.prompt_logprobs = False  # the request asked for prompt_logprobs
        self.created = int(time.time())
        self.num_top = num_top  # logprobs asked for: top alternatives per token
        self.echo = echo
        self.n = n  # choices per prompt: choice i echoes prompt i // n
        self._bytes: dict[int, bytes] = {}  # token id -> its UTF-8 bytes

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    # ---------------------------------------------------------------- chunks
    def completion_chunk(
        self,
        index: int,
        text: str,
        finish: str | None,
        logprobs: Any = None,
        *,
        stop_reason: int | str | None = None,
        usage: dict[str, int] | None = None,
        token_ids: list[int] | None = None,
        first: bool = False,
    ) -> dict[str, Any]:
        """One streamed completion choice delta; ``usage``: the running usage
        (``continuous_usage``); ``first``: the choice's first chunk, which
        carries its prompt's ids with ``return_token_ids``."""
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": stop_reason}
        if self.return_token_ids:
            choice["token_ids"] = token_ids or []
            if first:
                choice["prompt_token_ids"] = self.prompt_token_ids[index // self.n]
        body = self._envelope("text_completion", [choice])
        if self.include_usage:
            body["usage"] = usage
        return body

    def chat_chunk(
        self,
        index: int,
        delta: dict[str, Any],
        finish: str | None,
        logprobs: Any = None,
        *,
        stop_reason: int | str | None = None,
        usage: dict[str, int] | None = None,
        token_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        """One streamed chat delta; the finish chunk carries ``stop_reason``
        (as vLLM's), ``usage`` is the running usage (``continuous_usage``)."""
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        if self.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        body = self._envelope("chat.completion.chunk", [choice])
        if self.include_usage:
            body["usage"] = usage
        return body

    def chat_first_chunk(self, index: int, usage: dict[str, int] | None = None) -> dict[str, Any]:
        """A choice's opening role delta; the first of all carries the
        prompt's ids (``return_token_ids``) and text (``return_prompt_text``)."""
        body = self.chat_chunk(index, {"role": self.role, "content": ""}, None, usage=usage)
        if index == 0 and self.return_token_ids:
            body["prompt_token_ids"] = self.prompt_token_ids[0]
        if index == 0 and self.prompt_text is not None:
            body["prompt_text"] = self.prompt_text
        return body

    def running_usage(self, prompt_tokens: int, generated: int) -> dict[str, int] | None:
        """A chunk's ``usage`` with ``continuous_usage_stats``, else ``None``."""
        return running_usage(prompt_tokens, generated) if self.continuous_usage else None

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
        bodies = []
        for i, c in enumerate(choices):
            text, logprobs = self.completion_text_and_logprobs(
                i, "".join(c.text), c.token_ids, c.logprobs, c.top_logprobs, c.prompt_logprobs, 0,
                first=True,
            )
            body = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}
            if self.prompt_logprobs:
                body["prompt_logprobs"] = self.prompt_logprobs_body(c.prompt_logprobs)
            if self.return_token_ids:
                body["token_ids"] = c.token_ids
                body["prompt_token_ids"] = self.prompt_token_ids[i // self.n]
            bodies.append(body)
        generated = 0 if self.echo and self.echo.drop_generated else _generated(choices)
        return {
            **self._envelope("text_completion", bodies),
            "usage": usage(prompt_tokens, generated, cached_tokens),
        }

    def completion_text_and_logprobs(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        logprobs: list[float],
        tops: list[list[tuple[int, float]]],
        prompt_logprobs: list[Any] | None,
        start_offset: int,
        *,
        first: bool,
    ) -> tuple[str, dict[str, Any] | None]:
        """A completion choice's text and ``logprobs`` object (or one
        streamed delta of them; ``first``: the choice's first, which carries
        the echoed prompt)."""
        entries: list[tuple[int, float | None, list[tuple[int, float]]]] = []
        echo = self.echo
        if echo is not None and echo.drop_generated:
            text, token_ids, logprobs, tops = "", [], [], []
        if echo is not None and first:
            prompt = index // self.n
            text = echo.texts[prompt] + text
            if self.num_top is not None:
                ids = echo.token_ids[prompt]
                scored = prompt_logprobs or [None] * len(ids)
                entries += [
                    (tid, s.logprob if s else None, s.top if s else [])
                    for tid, s in zip(ids, scored, strict=False)
                ]
        if self.num_top is None:
            return text, None
        entries += [
            (tid, lp, tops[k] if k < len(tops) else [])
            for k, (tid, lp) in enumerate(zip(token_ids, logprobs, strict=False))
        ]
        return text, self.completion_logprobs(entries, start_offset, len(text))

    def chat_body(
        self, choices: list[CollectedChoice], prompt_tokens: int, cached_tokens: int = 0
    ) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.prompt_logprobs:  # one prompt: the first choice carries its scores
            extra["prompt_logprobs"] = self.prompt_logprobs_body(choices[0].prompt_logprobs)
        if self.return_token_ids:
            extra["prompt_token_ids"] = self.prompt_token_ids[0]
        if self.prompt_text is not None:
            extra["prompt_text"] = self.prompt_text
        bodies = []
        for i, c in enumerate(choices):
            body = {
                "index": i,
                **self.chat_message("".join(c.text), c.finish_reason),
                "stop_reason": c.stop_reason,
                "logprobs": self.chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs)
                if c.logprobs
                else None,
            }
            if self.return_token_ids:
                body["token_ids"] = c.token_ids
            bodies.append(body)
        return {
            **extra,
            **self._envelope("chat.completion", bodies),
            "usage": usage(prompt_tokens, _generated(choices), cached_tokens),
        }

    def chat_message(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        """``message`` and ``finish_reason`` of one choice: the reasoning split
        off first (``--reasoning-parser``), then tool calls parsed out of the
        rest when the request offered tools; a chat ``echo`` goes in front."""
        message: dict[str, Any] = {"role": self.role}
        content: str | None = text
        if self.reasoning_parser is not None:
            reasoning, content = split_reasoning(self.reasoning_parser, text)
            message["reasoning_content"] = reasoning if self.include_reasoning else None
        if self.tool_call_parser is not None:
            content, calls = parse_tool_calls(self.tool_call_parser, content or "")
            if calls:
                message["tool_calls"] = [c.to_dict() for c in calls]
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            if not content and self.reasoning_parser is not None:
                content = None  # all thought (or calls): no content, as vLLM
        if self.chat_echo:
            content = self.chat_echo + (content or "")
        message["content"] = content
        return {"message": message, "finish_reason": finish_reason}

    # -------------------------------------------------------------- logprobs
    def _token_text(self, token_id: int) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def prompt_logprobs_body(self, scored: list[Any] | None) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token (the first: null), token
        id -> ``{logprob, rank, decoded_token}`` for it and its top alternatives."""
        if not self.prompt_logprobs or scored is None:
            return None
        out: list[dict[str, Any] | None] = []
        for s in scored:
            if s is None:
                out.append(None)
                continue
            entry = {str(t): {"logprob": finite(v), "rank": k + 1, "decoded_token": self._token_text(t)}
                     for k, (t, v) in enumerate(s.top)}
            entry[str(s.token_id)] = {"logprob": finite(s.logprob), "rank": s.rank,
                                      "decoded_token": self._token_text(s.token_id)}
            out.append(entry)
        return out

    def _token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes a token stands for, also when it is part of one
        character (its text alone is then U+FFFD)."""
        data = self._bytes.get(token_id)
        if data is None:
            data = token_bytes(self.tokenizer, token_id)
            self._bytes[token_id] = data
        return data

    def completion_logprobs(
        self,
        entries: list[tuple[int, float | None, list[tuple[int, float]]]],
        start_offset: int,
        text_len: int,
    ) -> dict[str, Any]:
        """Completions' ``logprobs`` object over ``(token id, logprob, top)``
        entries (logprob ``None``: the first echoed prompt token). Each
        ``top_logprobs`` dict holds the token itself and its top alternatives
        (as vLLM); offsets count from the choice's text start, and a token
        inside a multi-byte character points at that character."""
        tokens = [self._token_text(tid) for tid, _, _ in entries]
        offsets, chars = [], 0
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        special = getattr(self.tokenizer, "special_token_ids", frozenset())
        for tid, _, _ in entries:
            offsets.append(start_offset + min(chars, text_len))
            if tid not in special:  # the text leaves special tokens out
                chars += len(decoder.decode(self._token_bytes(tid)))
        top_logprobs: list[dict[str, float] | None] = []
        for tok, (_, lp, top) in zip(tokens, entries, strict=True):
            if lp is None:
                top_logprobs.append(None)
                continue
            alternatives = {self._token_text(t): finite(v) for t, v in top}
            top_logprobs.append({**alternatives, tok: finite(lp)})
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else finite(lp) for _, lp, _ in entries],
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def chat_logprobs(
        self, token_ids: list[int], logprobs: list[float], tops: list[list[tuple[int, float]]]
    ) -> dict[str, Any]:
        """Chat's ``logprobs.content`` list, ``top_logprobs`` as OpenAI: the
        ``top_logprobs`` most likely tokens (the chosen one only if among them)."""
        content = []
        for k, (tid, lp) in enumerate(zip(token_ids, logprobs, strict=False)):
            tok = self._token_text(tid)
            top = [
                {"token": self._token_text(a), "logprob": finite(v), "bytes": list(self._token_bytes(a))}
                for a, v in (tops[k] if k < len(tops) else [])
            ]
            content.append({"token": tok, "logprob": finite(lp), "bytes": list(self._token_bytes(tid)),
                            "top_logprobs": top})
        return {"content": content}


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte tokens


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The bytes of one token: its text's, unless the token is a piece of a
    character (byte-level BPE pieces and ``<0xNN>`` byte-fallback tokens are
    read from the vocabulary)."""
    text = str(tokenizer.decode([token_id], skip_special_tokens=False))
    if "\ufffd" not in text:
        return text.encode()
    hf = getattr(tokenizer, "hf", tokenizer)
    piece = hf.id_to_token(token_id) if hasattr(hf, "id_to_token") else None
    if piece is None:
        return text.encode()
    if match := _BYTE_FALLBACK.fullmatch(piece):
        return bytes([int(match.group(1), 16)])
    alphabet = _byte_level_alphabet()
    if all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    return text.encode()


def _generated(choices: list[CollectedChoice]) -> int:
    return sum(c.num_generated or len(c.token_ids) for c in choices)
