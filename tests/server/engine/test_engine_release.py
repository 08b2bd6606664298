"""A dropped engine gives its KV pool back: the next engine in the same
process (a notebook, a test run, ``LLM`` made twice) sizes its pool from
memory the first one no longer holds."""

from __future__ import annotations

import gc
import weakref

import pytest

from paged_server.config import EngineConfig
from paged_server.engine.core.llm_engine import LLMEngine
from paged_server.sampling_params import SamplingParams


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_dropped_engine_and_its_pool_are_collected(tiny_loaded, compiled, monkeypatch) -> None:
    monkeypatch.setenv("PAGED_COMPILE", "1" if compiled else "0")
    engine = LLMEngine(EngineConfig(max_batch_size=2, max_model_len=64), tiny_loaded)
    assert (engine.worker.compiled is not None) == compiled
    engine.add_request("r0", [1, 2, 3], SamplingParams(max_tokens=3))
    while engine.has_unfinished():
        engine.step()
    gone = weakref.ref(engine.worker.tensors)
    del engine
    gc.collect()  # as kv_sizing does on CUDA before it measures free memory
    assert gone() is None
