"""LoRA adapters over HTTP, as a vLLM user serves them: ``--enable-lora
--lora-modules name=path`` (the flags parsed as ``serve`` parses them), the
adapter's name as the request's ``model`` through the openai client
(completions, chat), ``/v1/models`` listing adapters with their base as
``parent``, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` at
run time (only under ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), and
``paged:lora_requests_info``. Each adapter's text is transformers + PEFT's
merged model's greedy text."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from paged_server.default_model import ensure_default_model
from paged_server.entrypoints.cli import build_parser
from paged_server.entrypoints.openai.app import ServerSettings, create_app
from paged_server.entrypoints.openai.frontend_args import lora_requests
from paged_server.entrypoints.openai.lora_routes import RUNTIME_LORA_ENV
from paged_server.entrypoints.openai.server import ServerThread, build_engine, load_lora_modules

from .conftest import MODEL, engine_config

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
PROMPT = "def add(a, b):"


def make_adapter(hf: Any, path: Path, seed: int, targets: list[str]) -> Any:
    """A random PEFT adapter (B non-zero) saved at ``path``; its merged model."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(hf), LoraConfig(r=8, lora_alpha=16, target_modules=targets,
                                                              init_lora_weights=False))  # fmt: skip
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0)
    peft_model.save_pretrained(path)
    return peft_model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    hf = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32).eval()
    out: dict[str, tuple[Path, Any]] = {"tiny": (Path(), hf)}
    for seed, (name, targets) in enumerate({"sql": ["q_proj", "v_proj", "down_proj"],
                                            "chat": ["k_proj", "o_proj", "gate_proj", "up_proj"]}.items()):
        path = tmp_path_factory.mktemp(f"lora-{name}")
        out[name] = (path, make_adapter(hf, path, seed, targets))
    return out


@pytest.fixture(scope="module")
def lora_server(adapters: dict[str, tuple[Path, Any]]) -> Iterator[ServerThread]:
    args = build_parser().parse_args([
        "serve", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", f"sql={adapters['sql'][0]}",
        json.dumps({"name": "sql-json", "path": str(adapters["sql"][0]), "base_model_name": "tiny-base"}),
    ])  # fmt: skip
    assert (args.enable_lora, args.max_loras, args.max_lora_rank) == (True, 2, 8)
    engine = build_engine(engine_config(model=str(ensure_default_model()), enable_lora=True,
                                        max_loras=2, max_lora_rank=8))  # fmt: skip
    load_lora_modules(engine, lora_requests(args.lora_modules))
    with pytest.MonkeyPatch.context() as env:
        env.setenv(RUNTIME_LORA_ENV, "true")
        srv = ServerThread(engine, ServerSettings(model_name=MODEL)).start()
    yield srv
    srv.stop()


def oracle_text(server: ServerThread, model: Any, prompt: str) -> str:
    tokenizer = server.engine.tokenizer
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                             do_sample=False)  # fmt: skip
    return tokenizer.decode(out[0, len(ids):].tolist())


def complete(client: openai.OpenAI, model: str) -> Any:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip


def test_adapters_by_name_as_model(lora_server: ServerThread, adapters: dict[str, tuple[Path, Any]]) -> None:
    client = openai.OpenAI(base_url=lora_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "sql", "sql-json"}
    assert cards["sql"].parent == MODEL and cards["sql"].root == str(adapters["sql"][0])  # type: ignore[attr-defined]
    assert cards["sql-json"].parent == "tiny-base"  # type: ignore[attr-defined]
    texts = {}
    for model in (MODEL, "sql", "sql-json"):
        response = complete(client, model)
        assert response.model == model
        texts[model] = response.choices[0].text
    assert texts["sql"] == texts["sql-json"] == oracle_text(lora_server, adapters["sql"][1], PROMPT)
    assert texts[MODEL] == oracle_text(lora_server, adapters["tiny"][1], PROMPT) != texts["sql"]
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0)  # fmt: skip
    assert chat.model == "sql" and chat.choices[0].message.content is not None
    with httpx.Client(base_url=lora_server.url, timeout=60) as http:
        for path, body in (("/v1/responses", {"input": "hi", "max_output_tokens": 4}),
                           ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})):
            answer = http.post(path, json={"model": "sql", **body})
            assert answer.status_code == 200 and answer.json()["model"] == "sql", answer.text
    with pytest.raises(openai.NotFoundError, match="sql"):
        complete(client, "no-such-adapter")


def test_load_and_unload_at_run_time(lora_server: ServerThread, adapters: dict[str, tuple[Path, Any]]) -> None:
    client = openai.OpenAI(base_url=lora_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    path = str(adapters["chat"][0])
    with httpx.Client(base_url=lora_server.url, timeout=60) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": path})
        assert r.status_code == 200 and "added successfully" in r.text
        again = http.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": path})
        assert again.status_code == 400 and "already been loaded" in again.text
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/no/such/dir"})
        assert bad.status_code == 400 and "adapter_config.json" in bad.text
        assert "chat" in {m.id for m in client.models.list().data}
        assert complete(client, "chat").choices[0].text == oracle_text(lora_server, adapters["chat"][1], PROMPT)
        metrics = http.get("/metrics").text
        assert 'paged:lora_requests_info{max_lora="2"' in metrics
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
        assert r.status_code == 200 and "removed successfully" in r.text
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 404
    assert "chat" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        complete(client, "chat")


def test_runtime_routes_need_the_opt_in(lora_server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    def paths() -> set[str]:
        return set(create_app(lora_server.engine, ServerSettings(model_name=MODEL)).openapi()["paths"])

    monkeypatch.delenv(RUNTIME_LORA_ENV, raising=False)
    assert "/v1/load_lora_adapter" not in paths() and "/v1/models" in paths()
    monkeypatch.setenv(RUNTIME_LORA_ENV, "True")
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= paths()
