"""An SSE event stays one line for clients that split lines the way
``str.splitlines`` does (httpx's ``aiter_lines``): generated text may hold
U+0085, U+2028 or U+2029, which JSON with ``ensure_ascii=False`` leaves raw."""

from __future__ import annotations

import json

from httpx._decoders import LineDecoder

from paged_server.entrypoints.openai.streaming import sse


def test_every_event_is_one_line_for_a_splitlines_reader() -> None:
    payload = {"choices": [{"text": "a\x85b\u2028c\u2029d\ne\x1cé😀"}]}
    decoder = LineDecoder()
    lines = [line for line in decoder.decode(sse(payload).decode()) + decoder.flush() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: "):]) == payload
    assert "é😀" in lines[0]  # everything else stays raw UTF-8
