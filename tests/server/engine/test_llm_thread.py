"""The offline ``LLM`` runs on the caller's thread; stepping it on another
thread than the one that loaded the model (two torch thread pools, slower
steps) is said once in the log."""

from __future__ import annotations

import logging
import threading

import pytest

from paged_server.entrypoints.llm import LLM
from paged_server.sampling_params import SamplingParams


def test_generate_on_another_thread_warns_once(tiny_loaded, caplog: pytest.LogCaptureFixture) -> None:
    llm = LLM(loaded=tiny_loaded, device="cpu", attention_backend="ref", max_model_len=64)
    params = SamplingParams(max_tokens=2)
    with caplog.at_level(logging.WARNING, logger="paged_server.entrypoints.llm"):
        llm.generate("Hello", params)  # the building thread: nothing to say
        assert not caplog.records
        for _ in range(2):
            worker = threading.Thread(target=lambda: llm.generate("Hello", params))
            worker.start()
            worker.join()
    assert len(caplog.records) == 1
    assert "another thread than the one that built the LLM" in caplog.records[0].getMessage()
