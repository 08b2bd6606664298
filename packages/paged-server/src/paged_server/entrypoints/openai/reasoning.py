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

    def __post_init__(self) -> None:
        self._state = "reasoning" if REASONING_PARSERS[self.parser] else "start"

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """``(reasoning delta, content delta)`` for the next text delta."""
        text, self._held = self._held + delta, ""
        reasoning, content = "", ""
        while text:
            if self._state == "content":
                content += text
                break
            if self._state == "start":
                stripped = text.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._state, text = "reasoning", stripped[len(THINK_OPEN):]
                    continue
                if THINK_OPEN.startswith(stripped) and not final:
                    self._held = text  # maybe "<thi"...
                    break
                self._state = "content"
                continue
            # reasoning: up to the closing tag
            if reasoning == "" and text.startswith(THINK_OPEN):
                text = text[len(THINK_OPEN):]  # deepseek_r1 models sometimes repeat it
            end = text.find(THINK_CLOSE)
            if end >= 0:
                reasoning += text[:end]
                self._state, text = "content", text[end + len(THINK_CLOSE):].lstrip("\n")
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
