"""A real server for the end-to-end tests: the embedded tiny model behind
uvicorn on a free loopback port, in a background thread of the test process
(so tests can also audit the very engine the server drives)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from paged_server.config import EngineConfig
from paged_server.default_model import ensure_default_model
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


# A hermes-style template (the shape of Qwen's): tools in the system turn,
# calls as <tool_call> JSON, tool results as <tool_response> in a user turn.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call functions. Their signatures, within <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each call, return a JSON object within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{% for message in messages %}
{% if message.role == 'system' %}
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}{% for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""



def hermes_model(dest: Path) -> Path:
    """A copy of the embedded model whose chat template renders tools in
    the hermes (Qwen) style, for the tool-call tests."""
    path = dest / "model"
    shutil.copytree(ensure_default_model(), path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = HERMES_TEMPLATE
    config_file.write_text(json.dumps(config))
    return path


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


@pytest.fixture(scope="session")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """The embedded model with a hermes chat template (``hermes_model``)."""
    srv = start_server(model=str(hermes_model(tmp_path_factory.mktemp("hermes"))), max_model_len=1024)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def reasoning_server() -> Iterator[ServerThread]:
    """The embedded model with ``--reasoning-parser deepseek_r1``: its whole
    output is thought (the random weights never write ``</think>``)."""
    srv = start_server(ServerSettings(model_name=MODEL, reasoning_parser="deepseek_r1"))
    yield srv
    srv.stop()

