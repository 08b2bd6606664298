"""Server-sent events in OpenAI's streaming format.

Each event is ``data: <json>\\n\\n``; a stream ends with ``data: [DONE]``.
`EventStreamResponse` guarantees the body generator is closed when the
response ends for any reason, so a client that hangs up mid-stream has its
request aborted right away, not whenever the garbage collector gets to it.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One SSE event carrying ``payload`` as compact JSON."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response whose generator is always closed."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, headers: dict[str, str] | None = None) -> None:
        super().__init__(
            content,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
