"""The chat page at ``/`` in a real headless Chromium (Debian's ``chromium``,
driven by Playwright) against the server on the embedded model: a reply
streams in, stop frees the request, markup in a reply stays text, the key
is asked for, and the API is found behind ``--root-path``.

Skipped where Playwright or Chromium is not installed (CI installs both).
``PAGED_UPDATE_SCREENSHOT=1`` also writes docs/images/chat_page.png.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.e2e.conftest import MODEL, start_server, wait_idle

from paged_server.entrypoints.openai.app import ServerSettings

sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright package")
expect = sync_api.expect

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
REPLY = ".msg.assistant"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("needs Chromium (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        # a fresh temporary profile per launch; no sandbox: CI runs as root
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, chromium_sandbox=False)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1120, "height": 720})
    pg = context.new_page()
    pg.set_default_timeout(30_000)
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    yield pg
    context.close()
    assert not errors, f"the page raised: {errors}"


@pytest.fixture(scope="module")
def long_server() -> Iterator[Any]:
    """Room for a reply long enough to stop (2000 tokens take seconds here)."""
    srv = start_server(max_model_len=2048)
    yield srv
    srv.stop()


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^paged:{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert m, f"no paged:{name} in /metrics"
    return float(m.group(1))


def _reply_text(page: Any, i: int) -> str:
    return page.locator(f"{REPLY} .content").nth(i).text_content()


def test_a_reply_streams_in_and_stop_frees_the_request(page: Any, long_server: Any) -> None:
    server = long_server
    sent: list[dict[str, Any]] = []
    page.on("request", lambda r: sent.append(json.loads(r.post_data)) if r.method == "POST" else None)
    page.goto(server.url + "/")
    expect(page.locator("#embedded-note")).to_be_visible()  # random weights, said up front
    expect(page.locator("#model")).to_have_value(MODEL)
    page.click("#settings-toggle")
    page.fill("#max-tokens", "2000")
    page.fill("#temperature", "0")  # greedy: this prompt's reply runs to max tokens, no early EOS

    page.fill("#input", "Tell me a long story.")
    page.press("#input", "Enter")
    expect(page.locator(f"{REPLY} .content")).not_to_be_empty()
    expect(page.locator("#stop")).to_be_visible()
    first = len(_reply_text(page, 0))
    deadline = time.monotonic() + 30
    while len(_reply_text(page, 0)) <= first:  # it grows as tokens arrive: streamed, not at the end
        assert time.monotonic() < deadline, "the reply stopped growing"
        time.sleep(0.02)
    assert _metric(server.url, "num_requests_running") == 1
    page.click("#stop")
    stopped_at = time.monotonic()
    while _metric(server.url, "num_requests_running") != 0:
        assert time.monotonic() - stopped_at < 5, "the server kept the stopped request"
        time.sleep(0.05)
    freed_s = time.monotonic() - stopped_at
    wait_idle(server)
    expect(page.locator(f"{REPLY} .meta").first).to_contain_text("stopped")
    expect(page.locator("#send")).to_be_visible()
    partial = _reply_text(page, 0)
    time.sleep(0.3)
    assert _reply_text(page, 0) == partial  # nothing more arrives
    print(f"stop -> running 0 in {freed_s:.2f} s")

    # Shift+Enter is a new line; Enter sends (the stopped reply stays in the conversation).
    page.fill("#max-tokens", "12")
    page.fill("#input", "Thanks!")
    page.press("#input", "Shift+Enter")
    page.type("#input", "One more, shorter.")
    assert len(sent) == 1
    prompt_before = _metric(server.url, "prompt_tokens_total")
    generated_before = _metric(server.url, "generation_tokens_total")
    page.press("#input", "Enter")
    meta = page.locator(f"{REPLY} .meta").nth(1)
    expect(meta).to_contain_text("tokens/s", timeout=60_000)
    m = re.match(r"(\d+) prompt \+ (\d+) completion tokens · [\d.]+ tokens/s · first token [\d.]+ s",
                 meta.text_content())
    assert m, meta.text_content()
    # the page shows the server's own counts (its usage chunk)
    assert int(m[1]) == _metric(server.url, "prompt_tokens_total") - prompt_before
    assert int(m[2]) == _metric(server.url, "generation_tokens_total") - generated_before
    assert 1 <= int(m[2]) <= 12
    body = sent[1]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 12 and body["model"] == MODEL
    assert body["messages"] == [
        {"role": "user", "content": "Tell me a long story."},
        {"role": "assistant", "content": partial},
        {"role": "user", "content": "Thanks!\nOne more, shorter."},
    ]
    expect(page.locator(".msg.user .content").nth(1)).to_have_text("Thanks!\nOne more, shorter.")
    if os.environ.get("PAGED_UPDATE_SCREENSHOT") == "1":
        _screenshot(page)


def _screenshot(page: Any) -> None:
    """docs/images/chat_page.png: a fresh chat, settings open."""
    page.click("#new-chat")
    page.fill("#system", "You are a friendly assistant.")
    page.fill("#temperature", "0.8")
    page.fill("#max-tokens", "48")
    page.fill("#input", "Hello! What can you do?")
    page.press("#input", "Enter")
    expect(page.locator(f"{REPLY} .meta")).to_contain_text("tokens/s", timeout=60_000)
    page.locator("#input").blur()
    page.mouse.move(400, 500)  # no hover highlight
    page.screenshot(path=str(ROOT / "docs" / "images" / "chat_page.png"))


MARKUP = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"><b>bold</b>'


def test_markup_in_a_reply_shows_as_text_and_reasoning_apart(page: Any, long_server: Any) -> None:
    """A crafted stream (the embedded model cannot be made to say it) through the
    page's own fetch, parser and rendering: every byte shows as text."""
    chunks = [{"choices": [{"index": 0, "delta": {"reasoning_content": "<i>think</i> first"}}]},
              {"choices": [{"index": 0, "delta": {"content": MARKUP[:20]}}]},
              {"choices": [{"index": 0, "delta": {"content": MARKUP[20:]}, "finish_reason": "stop"}]},
              {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}}]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions",
               lambda route: route.fulfill(status=200, content_type="text/event-stream", body=sse))
    page.goto(long_server.url + "/")
    expect(page.locator("#model")).to_have_value(MODEL)
    page.fill("#input", "Say some HTML")
    page.press("#input", "Enter")
    expect(page.locator(f"{REPLY} .meta")).to_contain_text("9 prompt + 3 completion tokens")
    expect(page.locator(f"{REPLY} .content")).to_have_text(MARKUP)
    expect(page.locator(f"{REPLY} .reasoning")).to_be_visible()
    expect(page.locator(f"{REPLY} .reasoning .text")).to_have_text("<i>think</i> first")
    assert page.locator("#messages script, #messages img, #messages b, #messages i").count() == 0
    assert page.locator("script").count() == 1  # the page's own
    assert page.evaluate("window.__pwned") is None


def test_the_key_is_asked_for_and_the_api_found_behind_root_path(page: Any) -> None:
    """--api-key and --root-path /llm behind a proxy that strips /llm (the
    browser's routing plays the proxy): the page is open, it asks for the key,
    keeps it in the tab only, and every call it makes stays under /llm/."""
    srv = start_server(ServerSettings(model_name=MODEL, api_key="sesame", root_path="/llm"))
    try:
        seen: list[str] = []

        def proxy(route: Any) -> None:
            seen.append(route.request.url)
            stripped = route.request.url.replace(srv.url + "/llm", srv.url, 1)
            route.fulfill(response=route.fetch(url=stripped))

        page.route(srv.url + "/**", proxy)
        page.goto(srv.url + "/llm/")
        dialog = page.locator("#key-dialog")
        expect(dialog).to_be_visible()
        page.fill("#key-input", "wrong")
        page.click("#key-dialog button[type=submit]")
        expect(page.locator("#key-error")).to_have_text("The server refused this key.")
        page.fill("#key-input", "sesame")
        page.click("#key-dialog button[type=submit]")
        expect(dialog).to_be_hidden()
        expect(page.locator("#model")).to_have_value(MODEL)
        page.click("#settings-toggle")
        page.fill("#max-tokens", "4")
        page.fill("#input", "Hi")
        page.press("#input", "Enter")
        expect(page.locator(f"{REPLY} .meta")).to_contain_text("completion tokens", timeout=60_000)
        assert page.evaluate("sessionStorage.getItem('paged.chat.apiKey')") == "sesame"
        assert "sesame" not in page.evaluate("JSON.stringify(localStorage)")
        paths = [u.removeprefix(srv.url) for u in seen]
        assert "/llm/v1/models" in paths and "/llm/v1/chat/completions" in paths
        assert all(p.startswith("/llm/") for p in paths), paths
    finally:
        srv.stop()
