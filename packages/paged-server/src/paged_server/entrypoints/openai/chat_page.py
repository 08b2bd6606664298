"""The chat page at ``/`` (``chat_page.html``, shipped with the package), so a
first-time user can talk to the served model from a browser, as llama.cpp's
server offers.

The page is one static file: it calls the same API as any client (relative
URLs, so it works behind ``--root-path``) and needs no endpoint of its own.
It holds no secret, so it is served without the API key; the API it calls
keeps its key. A Content-Security-Policy that allows only the page's own
script and style (by hash) keeps any HTML that could slip into the page
from running. ``--disable-web-ui`` leaves ``/`` a 404.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

PAGE_PATH = "/"


def _hash_source(html: str, tag: str) -> str:
    """The CSP source allowing the page's one inline ``<tag>`` element."""
    match = re.search(rf"<{tag}>(.*?)</{tag}>", html, re.DOTALL)
    assert match, f"chat_page.html has no <{tag}> element"
    digest = hashlib.sha256(match.group(1).encode()).digest()
    return f"'sha256-{base64.b64encode(digest).decode()}'"


def page_html(embedded_model: bool) -> str:
    """The page's HTML; ``embedded_model`` shows the note that the embedded
    default model's weights are random."""
    html = resources.files(__package__).joinpath("chat_page.html").read_text(encoding="utf-8")
    if embedded_model:
        html = html.replace("<body>", '<body data-embedded-model="true">', 1)
    return html


def page_headers(html: str) -> dict[str, str]:
    """No script, style or connection but the page's own; not framed; not cached
    stale after an upgrade."""
    csp = "; ".join([
        "default-src 'none'",
        f"script-src {_hash_source(html, 'script')}",
        f"style-src {_hash_source(html, 'style')}",
        "connect-src 'self'",
        "img-src data:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ])
    return {
        "Content-Security-Policy": csp,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }


def chat_page_router(embedded_model: bool) -> APIRouter:
    """``GET /``: the chat page (not in the OpenAPI schema: not an API)."""
    router = APIRouter()
    html = page_html(embedded_model)
    headers = page_headers(html)

    @router.api_route(PAGE_PATH, methods=["GET", "HEAD"], include_in_schema=False)
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(html, headers=headers)

    return router
