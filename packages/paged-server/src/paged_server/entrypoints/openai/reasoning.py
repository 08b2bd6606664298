"""Reasoning parsers (``--reasoning-parser``): a thinking model's
``<think>...</think>`` goes to ``reasoning_content``, the rest to ``content``.

- ``qwen3``: the output opens with ``<think>`` when the model thinks; an
  output without it is all content (``enable_thinking: false``).
- ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the
  output is reasoning up to ``</think>`` (an opening tag, if the model writes
  one, is dropped).

A thought cut off by ``max_tokens`` (no ``</think>``) is reasoning, streamed
or not. vLLM's qwen3 parser calls it content when not streaming but streams
it as reasoning; here both agree.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# parser -> whether the output starts inside the thought
REASONING_PARSERS = {"qwen3": False, "deepseek_r1": True}


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """``(reasoning_content, content)`` of a whole output (``None`` when empty)."""
    stream = ReasoningStream(parser)
    reasoning, content = stream.feed(text, final=True)
    return reasoning or None, content or None


@dataclass(slots=True)
class ReasoningStream:
    """Splits streamed text deltas; a tag split over deltas is held back
    until it is known whether it is one."""

    parser: str
    _state: str = ""  # "start" | "reasoning" | "content"
    _held: str = ""
    _fresh: bool = True  # nothing of the thought seen yet (a repeated <think> is dropped)
    _after_thought: bool = False  # newlines right after </think> are dropped

    def __post_init__(self) -> None:
        self._state = "reasoning" if REASONING_PARSERS[self.parser] else "start"

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """``(reasoning delta, content delta)`` for the next text delta."""
        text, self._held = self._held + delta, ""
        reasoning, content = "", ""
        while text:
            if self._state == "content":
                if self._after_thought:
                    text = text.lstrip("\n")
                    self._after_thought = not text
                content += text
                break
            stripped = text.lstrip()
            if self._state == "start" or self._fresh:
                if stripped.startswith(THINK_OPEN):
                    self._state, self._fresh, text = "reasoning", False, stripped[len(THINK_OPEN):]
                    continue
                if THINK_OPEN.startswith(stripped) and not final:
                    self._held = text  # maybe "<thi"...
                    break
                self._fresh = False
                if self._state == "start":
                    self._state = "content"
                    continue
            end = text.find(THINK_CLOSE)  # reasoning: up to the closing tag
            if end >= 0:
                reasoning += text[:end]
                self._state, self._after_thought = "content", True
                text = text[end + len(THINK_CLOSE):]
                if not text:
                    break
                continue
            keep = 0 if final else _partial_suffix(text, THINK_CLOSE)
            reasoning += text[: len(text) - keep]
            self._held = text[len(text) - keep:]
            break
        return reasoning, content


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that starts ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
