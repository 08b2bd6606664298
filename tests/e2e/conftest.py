"""A real server for the end-to-end tests: the embedded tiny model behind
uvicorn on a free loopback port, in a background thread of the test process
(so tests can also audit the very engine the server drives)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from paged_server.config import EngineConfig
from paged_server.entrypoints.openai.app import ServerSettings
from paged_server.entrypoints.openai.server import ServerThread, build_engine

MODEL = "tiny"
MAX_SEQ_LEN = 256


def engine_config(**overrides: Any) -> EngineConfig:
    """Small and CPU-friendly; paged KV with the reference attention."""
    values: dict[str, Any] = {
        "kv_cache_backend": "paged",
        "attention_backend": "ref",
        "device": "cpu",
        "dtype": "float32",
        "max_model_len": MAX_SEQ_LEN,
        "max_batch_size": 64,
        "max_num_batched_tokens": 1024,
    }
    values.update(overrides)
    return EngineConfig(**values)


def start_server(settings: ServerSettings | None = None, **config: Any) -> ServerThread:
    engine = build_engine(engine_config(**config))
    return ServerThread(engine, settings or ServerSettings(model_name=MODEL)).start()


def wait_idle(server: ServerThread, timeout: float = 30.0) -> dict[str, float]:
    """Wait until the engine has nothing running or waiting; its metrics then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.async_engine.metrics()
        idle = m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0
        if idle and not server.engine.has_unfinished():
            return server.async_engine.metrics()
        time.sleep(0.05)
    raise AssertionError(f"engine still busy after {timeout} s: {server.async_engine.metrics()}")


@pytest.fixture(scope="session")
def server() -> Iterator[ServerThread]:
    srv = start_server()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
