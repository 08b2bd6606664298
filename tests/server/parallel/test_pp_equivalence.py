"""PP=2 gives the same tokens as one rank, and each stage's pool holds only its layers.

Real worker processes over loopback gloo, tiny random checkpoints made by
transformers (``conftest.tp_checkpoints``, two layers: one per stage). The
workload is the TP tests' one: shared prefixes (prefix-cache hits), prompts
longer than the step budget (chunked prefill), more KV demand than the pool
holds (preemption and recompute) and an ``n=2`` request (copy-on-write
forks replayed on every stage).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from paged_server.config import EngineConfig
from paged_server.entrypoints.llm import LLM
from paged_server.parallel import WorkerStartError
from tests.server.parallel.test_tp_equivalence import BASE, POOLS, _workload

pytestmark = pytest.mark.timeout(300)


def _generate(path: Path, tp: int = 1, pp: int = 1, **extra: Any) -> dict[str, Any]:
    prompts, params = _workload()
    config = {**BASE, **POOLS["paged"], **extra}
    with LLM(str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp, **config) as llm:
        engine = llm.engine
        results = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        metrics = engine.metrics()
        assert engine.audit() == []
        out = {
            "tokens": [[c.token_ids for c in r.outputs] for r in results],
            "preemptions": metrics["num_preemptions_total"],
            "prefix_hits": metrics["prefix_cache_hits_total"],
            "summary": engine.parallel_summary(),
            "sends": engine.executor.group.counts.sends if engine.executor else 0,
        }
        workers = list(engine.executor.workers) if engine.executor else []
    assert all(not w.is_alive() for w in workers), "workers must exit with the LLM"
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_pp2_matches_one_rank_token_for_token(tp_checkpoints: dict[str, Path], family: str) -> None:
    path = tp_checkpoints[family]
    one = _generate(path)
    two = _generate(path, pp=2)
    assert two["tokens"] == one["tokens"]
    assert two["preemptions"] == one["preemptions"] > 0
    assert two["prefix_hits"] == one["prefix_hits"] > 0
    assert "pipeline_parallel_size=2: layers split 1+1" in two["summary"]
    assert two["sends"] > 0  # rank 0 sent its stage's activations on


def test_bad_pipeline_settings_are_refused_in_one_line(tp_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"pipeline_parallel_size > 1 needs kv_cache_backend='paged'"):
        EngineConfig(pipeline_parallel_size=2, kv_cache_backend="contiguous").validate()
    with pytest.raises(ValueError, match=r"pipeline_parallel_size: must be an integer >= 1, got 0"):
        EngineConfig(pipeline_parallel_size=0).validate()
    # Three stages for two layers: refused before any worker process starts.
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(3\) exceeds the model's 2 layers"):
        LLM(str(tp_checkpoints["llama"]), pipeline_parallel_size=3, **BASE, **POOLS["paged"])
