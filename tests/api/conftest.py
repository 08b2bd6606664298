"""A scripted stand-in for `LLMEngine` (same API as docs/contracts.md), so the
HTTP layer's own logic -- routing, SSE framing, errors, aborts -- is tested
fast and deterministically without forward passes. The real engine is
exercised end to end in tests/e2e."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from paged_server.config import EngineConfig
from paged_server.errors import QueueFullError
from paged_server.outputs import RequestOutput
from paged_server.tokenizer import Tokenizer

WORDS = [" alpha", " beta", " gamma", " delta", " epsilon", " zeta", " eta", " theta"]


@dataclass
class _FakeRequest:
    prompt: list[int]
    params: Any
    generated: list[int] = field(default_factory=list)  # per choice, via index
    counts: list[int] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)


class FakeEngine:
    """Generates a fixed word sequence (rotated by prompt length) per choice,
    one token per step; honours max_tokens, n, logprobs, aborts and the queue
    limit. ``fail_steps`` makes the next steps raise; ``step_delay`` slows steps."""

    def __init__(self, tokenizer: Tokenizer, *, max_model_len: int = 256, max_queue_len: int = 64,
                 max_running: int = 1000, step_delay: float = 0.0) -> None:
        # a CPU engine's config (the fake runs here): it waits for the event
        # loop as one does, on any machine (``auto`` would not on a GPU's)
        self.config = EngineConfig(max_model_len=max_model_len, max_queue_len=max_queue_len, device="cpu")
        self.tokenizer = tokenizer
        self.capacity = SimpleNamespace(num_blocks=256)
        self.default_sampling: dict[str, Any] = {}
        self.model_config = SimpleNamespace(vocab_size=tokenizer.vocab_size)
        self.max_running = max_running
        self.step_delay = step_delay
        self.fail_steps = 0
        self.requests: dict[str, _FakeRequest] = {}
        self.aborted: list[str] = []
        self.added: list[str] = []
        self.steps = 0
        self.audits = 0
        self.audit_problems: list[str] = []
        self.thread_ids: set[int] = set()
        self.word_ids = [tokenizer.encode(w, add_special_tokens=False) for w in WORDS]

    def _touch(self) -> None:
        self.thread_ids.add(threading.get_ident())

    def add_request(self, request_id: str, prompt: Any, params: Any) -> int:
        self._touch()
        ids = prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        params.validate(self.config.max_model_len)
        waiting = max(0, len(self.requests) - self.max_running)
        if waiting >= self.config.max_queue_len:
            raise QueueFullError(f"{waiting} requests are waiting (max_queue_len)")
        n = params.n
        self.requests[request_id] = _FakeRequest(list(ids), params, [0] * n, [0] * n, [False] * n)
        self.added.append(request_id)
        return len(ids)

    def abort_request(self, request_id: str) -> None:
        self._touch()
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self._touch()
        self.steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.fail_steps > 0:
            self.fail_steps -= 1
            raise RuntimeError("scripted step failure")
        outs = []
        running = list(self.requests.items())[: self.max_running]
        for rid, req in running:
            for i in range(req.params.n):
                if req.done[i]:
                    continue
                k = req.counts[i]
                word = (len(req.prompt) + k + i) % len(WORDS)
                req.counts[i] += 1
                finished = req.counts[i] >= req.params.max_tokens
                req.done[i] = finished
                outs.append(RequestOutput(
                    request_id=rid, index=i, new_token_ids=list(self.word_ids[word]),
                    new_text=WORDS[word], new_logprobs=[-0.5] * len(self.word_ids[word])
                    if req.params.logprobs is not None else None,
                    finished=finished, finish_reason="length" if finished else None, error=None,
                    num_prompt_tokens=len(req.prompt), num_generated_tokens=req.counts[i],
                ))
            if all(req.done):
                del self.requests[rid]
        return outs

    def metrics(self) -> dict[str, float]:
        return {"num_requests_running": float(min(len(self.requests), self.max_running)),
                "num_requests_waiting": float(max(0, len(self.requests) - self.max_running)),
                "kv_cache_usage_perc": 0.0, "num_preemptions_total": 0.0,
                "prefix_cache_queries_total": 0.0, "prefix_cache_hits_total": 0.0,
                "prompt_tokens_total": 0.0, "generation_tokens_total": float(self.steps),
                "kv_capacity_tokens": 4096.0, "kv_capacity_blocks": 256.0}

    def audit(self) -> list[str]:
        self._touch()
        self.audits += 1
        return list(self.audit_problems)

    def reclaim_leaked(self) -> list[int]:
        self._touch()
        reclaimed, self.audit_problems = list(range(len(self.audit_problems))), []
        return reclaimed

    def parallel_summary(self) -> str | None:
        return None

    def shutdown(self) -> None:
        pass

    def expected_text(self, prompt_len: int, max_tokens: int, index: int = 0) -> str:
        return "".join(WORDS[(prompt_len + k + index) % len(WORDS)] for k in range(max_tokens))


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    from paged_server.default_model import ensure_default_model

    return Tokenizer.from_dir(ensure_default_model())


@pytest.fixture
def make_fake_engine(tokenizer: Tokenizer) -> Any:
    """``make_fake_engine(**kwargs)`` -> a `FakeEngine` with those settings."""
    return lambda **kwargs: FakeEngine(tokenizer, **kwargs)


@pytest.fixture
def fake_engine(tokenizer: Tokenizer) -> FakeEngine:
    return FakeEngine(tokenizer)


@pytest.fixture
def fake_server(fake_engine: FakeEngine) -> Any:
    from paged_server.entrypoints.openai.app import ServerSettings
    from paged_server.entrypoints.openai.server import ServerThread

    with ServerThread(fake_engine, ServerSettings(model_name="fake-model", shutdown_timeout_s=2)) as srv:
        yield srv
