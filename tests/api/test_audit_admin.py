"""The periodic KV audit while idle, and reclaim as an explicit operator
action behind the API key."""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import pytest

from paged_server.entrypoints.openai.app import ServerSettings
from paged_server.entrypoints.openai.async_engine import AsyncEngine
from paged_server.entrypoints.openai.metrics import ServerMetrics
from paged_server.entrypoints.openai.server import ServerThread


def wait_for(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_idle_engine_is_audited_periodically_and_findings_logged(fake_engine: Any, caplog) -> None:
    fake_engine.audit_problems = ["block 3 is leaked"]
    ae = AsyncEngine(fake_engine, ServerMetrics("m"), audit_interval_s=0.05)
    with caplog.at_level(logging.ERROR, logger="paged_server.entrypoints.openai"):
        ae.start()
        try:
            wait_for(lambda: fake_engine.audits >= 3)
        finally:
            ae.stop()
    assert any("KV block audit found 1 problem(s): block 3 is leaked" in r.getMessage()
               for r in caplog.records)
    assert fake_engine.audit_problems  # reported, never reclaimed on its own


def test_audit_interval_zero_never_audits(fake_engine: Any) -> None:
    ae = AsyncEngine(fake_engine, audit_interval_s=0.0)
    ae.start()
    time.sleep(0.3)
    ae.stop()
    assert fake_engine.audits == 0


@pytest.mark.e2e
def test_admin_reclaim_needs_an_api_key(fake_server: Any) -> None:
    resp = httpx.post(fake_server.url + "/admin/reclaim", timeout=10)
    assert resp.status_code == 403
    assert "--api-key" in resp.json()["error"]["message"]


@pytest.mark.e2e
def test_admin_reclaim_frees_what_the_audit_found(fake_engine: Any) -> None:
    fake_engine.audit_problems = ["leak a", "leak b"]
    settings = ServerSettings(model_name="m", api_key="sekret", shutdown_timeout_s=2)
    with ServerThread(fake_engine, settings) as srv:
        assert httpx.post(srv.url + "/admin/reclaim", timeout=10).status_code == 401
        resp = httpx.post(srv.url + "/admin/reclaim", timeout=10,
                          headers={"Authorization": "Bearer sekret"})
    assert resp.status_code == 200
    assert resp.json() == {"reclaimed_blocks": [0, 1], "audit": []}
