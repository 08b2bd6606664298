"""The chat page's HTTP side (scripted engine): served at ``/`` with a CSP,
open without the API key while every API route still needs it, gone with
``--disable-web-ui``; and its script never parses text as HTML. The page
itself runs in a browser in tests/e2e/test_chat_page.py."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from paged_server.entrypoints.cli import build_parser
from paged_server.entrypoints.openai.chat_page import page_html
from paged_server.entrypoints.openai.frontend_args import settings_from_args
from paged_server.entrypoints.openai.middleware import OPEN_PATHS
from paged_server.entrypoints.openai.server import ServerThread


def _settings(*argv: str, api_key: str | None = None) -> Any:
    return settings_from_args(build_parser().parse_args(["serve", *argv]), "fake-model", api_key)


def test_page_is_open_and_every_api_route_still_needs_the_key(make_fake_engine: Any) -> None:
    with ServerThread(make_fake_engine(), _settings(api_key="sesame")) as srv:
        page = httpx.get(srv.url + "/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "<title>paged · chat</title>" in page.text
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'sha256-" in csp and "unsafe" not in csp
        assert "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert httpx.head(srv.url + "/").status_code == 200
        assert 'data-embedded-model="true"' in page.text  # the fake engine names no --model
        # the page opens nothing else: every other route answers 401 without the key
        schema = srv.app.openapi()["paths"]
        routes = [(m.upper(), p.replace("{model_id}", "fake-model")) for p in schema for m in schema[p]]
        routes += [("GET", "/docs"), ("GET", "/openapi.json")]
        assert ("POST", "/v1/chat/completions") in routes
        for method, path in routes:
            if path in OPEN_PATHS | {"/metrics"}:
                continue
            status = httpx.request(method, srv.url + path).status_code
            assert status == 401, f"{method} {path}: {status} without the key"


@pytest.mark.parametrize("flag", ["--disable-web-ui", "--no-webui"])
def test_disable_web_ui_leaves_root_a_404(make_fake_engine: Any, flag: str) -> None:
    assert _settings().enable_web_ui is True
    with ServerThread(make_fake_engine(), _settings(flag)) as srv:
        assert httpx.get(srv.url + "/").status_code == 404
    with ServerThread(make_fake_engine(), _settings(flag, api_key="sesame")) as srv:
        assert httpx.get(srv.url + "/").status_code == 401  # not opened either


def test_page_script_never_parses_text_as_html_nor_leaves_the_server() -> None:
    """Model output reaches the page only as text, and the page calls only
    its own server through relative URLs (so --root-path works)."""
    html = page_html(embedded_model=False)
    script = re.search(r"<script>(.*?)</script>", html, re.DOTALL)[1]
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                 "new Function", "DOMParser", "createContextualFragment", "srcdoc"):
        assert sink not in script, sink
    assert re.findall(r"fetch\(([^,)]+)", script) == ['BASE + "v1/models"', 'BASE + "v1/chat/completions"']
    assert not re.search(r"https?://", script)
    assert not re.search(r'(?:src|href)="(?:https?:)?//', html)  # nothing from a CDN: works offline
