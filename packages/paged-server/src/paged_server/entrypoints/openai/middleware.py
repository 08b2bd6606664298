"""Pure-ASGI guards that run before any handler: API key and body size.

Plain ASGI (not ``BaseHTTPMiddleware``) so streaming responses and client
disconnects pass through untouched.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from paged_server.entrypoints.openai.errors import error_bytes

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB
# Probes a load balancer sends without credentials (vLLM leaves these open too).
OPEN_PATHS = frozenset({"/health", "/ping", "/load"})


async def _send_error(
    send: Send, status: int, message: str, *, code: str | None = None, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = error_bytes(status, message, code=code)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _path(scope: Scope) -> str:
    """The request path below ``--root-path`` (a proxy may keep the prefix)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class APIKeyMiddleware:
    """With a key set, every path but ``open_paths`` (``OPEN_PATHS`` by
    default) needs ``Authorization: Bearer <key>`` or ``x-api-key: <key>``
    (Anthropic's header)."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, open_paths: frozenset[str] = OPEN_PATHS
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_key is None or scope["type"] != "http" or _path(scope) in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer":  # Anthropic's clients send the key as x-api-key
            token = headers.get(b"x-api-key", b"")
        if not hmac.compare_digest(token.strip(), self.api_key):
            what = "missing" if not token else "wrong"
            await _send_error(
                send,
                401,
                f"{what} API key: send the header 'Authorization: Bearer <key>' (or 'x-api-key: "
                "<key>') with the key the server was started with (--api-key)",
                code="invalid_api_key",
                headers=[(b"www-authenticate", b"Bearer")],
            )
            return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Reject request bodies over ``max_bytes`` with 413, before parsing them.

    A declared Content-Length over the limit is refused at once; a chunked
    body is buffered up to the limit and refused as soon as it goes over.
    The buffered body is then replayed to the app, and later ``receive``
    calls (disconnect detection) go to the server as usual.
    """

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send, int(declared))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send, size)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send, size: int) -> None:
        await _send_error(
            send,
            413,
            f"request body is {size} bytes or more, over the limit of {self.max_bytes} bytes; "
            "send a shorter prompt (or start the server with a larger --max-body-bytes)",
            code="body_too_large",
        )
