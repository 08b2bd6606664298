"""TP=2 gives the same tokens as TP=1, and talks only as much as it must.

Each case runs one workload through ``LLM.generate`` twice, with
``tensor_parallel_size`` 1 and 2 (gloo on CPU, real worker processes). The
workload shares prompt prefixes (prefix-cache hits), has prompts longer
than the step budget (chunked prefill), more KV demand than the paged pool
holds (preemption and recompute), and one ``n=2`` request (forks:
copy-on-write in the paged pool, a row copy in the contiguous one).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from paged_server.entrypoints.llm import LLM
from paged_server.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

BASE: dict[str, Any] = dict(
    device="cpu",
    dtype="float32",
    attention_backend="ref",
    max_model_len=64,
    max_num_batched_tokens=16,  # prompts of 20+ tokens run in chunks
    block_size=4,
)
POOLS: dict[str, dict[str, Any]] = {
    # 24 blocks of 4 = 96 tokens for ~5 sequences of up to 44: preemption.
    "paged": dict(kv_cache_backend="paged", num_gpu_blocks=24, max_batch_size=4),
    "contiguous": dict(kv_cache_backend="contiguous", max_batch_size=4),
}
PREFIX = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # three full blocks


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [
        PREFIX + [100 + i for i in range(12)],
        PREFIX + [200 + i for i in range(10)],
        [300 + i for i in range(21)],
        PREFIX + [400, 401, 402],
        [50, 51, 52, 53, 54],
    ]
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    forked = SamplingParams(max_tokens=12, n=2, temperature=0.8, seed=7, ignore_eos=True)
    return prompts, [greedy, greedy, greedy, greedy, forked]


def _generate(
    path: Path, tp: int, pool: str, count_comms: bool = False, **extra: Any
) -> dict[str, Any]:
    prompts, params = _workload()
    with LLM(str(path), tensor_parallel_size=tp, **{**BASE, **POOLS[pool], **extra}) as llm:
        engine = llm.engine
        calls: Counter[str] = Counter()
        passes = [0]
        if count_comms:
            group = engine.executor.group
            group.device_pg = _Counting(group.device_pg, calls, "device")
            group.message_pg = _Counting(group.message_pg, calls, "message")
            execute = engine._forward

            def counted(scheduled: Any) -> Any:
                passes[0] += 1
                return execute(scheduled)

            engine._forward = counted
            group.counts.all_reduces = group.counts.broadcasts = 0
        results = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        metrics = engine.metrics()
        assert engine.audit() == []
        out = {
            "tokens": [[c.token_ids for c in r.outputs] for r in results],
            "preemptions": metrics["num_preemptions_total"],
            "prefix_hits": metrics["prefix_cache_hits_total"],
            "calls": dict(calls),
            "passes": passes[0],
            "layers": engine.model_config.num_layers,
            "kv_cache_groups": engine.capacity.num_groups,
            "sized_by": engine.capacity.sized_by,
            "graph_steps": engine.worker.graphs.steps if engine.worker.graphs else 0,
            "drafts": metrics["spec_decode_num_draft_tokens_total"],
            "blocks": engine.capacity.num_blocks,
        }
        workers = list(getattr(engine.executor, "workers", []))
    assert all(not w.is_alive() for w in workers), "workers must exit with the LLM"
    return out


class _Counting:
    """Counts every call made on a process group, by method name."""

    def __init__(self, pg: Any, calls: Counter[str], label: str) -> None:
        self._pg, self._calls, self._label = pg, calls, label

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._pg, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._calls[f"{self._label}.{name}"] += 1
            return attr(*args, **kwargs)

        return call


@pytest.mark.parametrize(
    ("family", "pool"),
    [
        ("llama", "paged"),
        ("llama", "contiguous"),
        ("qwen3", "paged"),
        ("gemma3", "paged"),
        ("phi3", "paged"),  # each rank's q/k/v and gate/up rows of stacked checkpoint tensors
        ("mixtral", "contiguous"),  # every expert split along its features, one all-reduce
    ],
)
def test_tp2_matches_tp1_token_for_token(
    tp_checkpoints: dict[str, Path], family: str, pool: str
) -> None:
    path = tp_checkpoints[family]
    count = family == "llama" and pool == "paged"
    # Gemma 3 (one sliding, one global layer) runs with a hybrid KV cache: two
    # KV cache groups, each page table in the step message.
    one = _generate(path, 1, pool)
    two = _generate(path, 2, pool, count_comms=count)
    if family == "gemma3":
        assert one["kv_cache_groups"] == two["kv_cache_groups"] == 2
    assert two["tokens"] == one["tokens"]
    assert two["preemptions"] == one["preemptions"]
    assert two["prefix_hits"] == one["prefix_hits"]
    if pool == "paged":  # the workload did exercise what it is meant to
        assert one["preemptions"] > 0 and one["prefix_hits"] > 0
    if count:
        # Per forward pass: one step message (one broadcast while it fits
        # 64 KiB) and two all-reduces per layer; nothing else on rank 0.
        passes = two["passes"]
        assert passes > 0
        assert two["calls"] == {
            "message.broadcast": passes,
            "device.allreduce": 2 * two["layers"] * passes,
        }


def test_tp2_with_async_output_proc_matches_tp1(tp_checkpoints: dict[str, Path]) -> None:
    """``async_output_proc`` moves only rank 0's text making, so a TP=2
    engine under preemption streams what a TP=1 engine without it does."""
    path = tp_checkpoints["llama"]
    one = _generate(path, 1, "paged")
    two = _generate(path, 2, "paged", async_output_proc=True)
    assert two["tokens"] == one["tokens"]
    assert two["preemptions"] == one["preemptions"] > 0


def test_tp2_with_async_scheduling_matches_tp1(tp_checkpoints: dict[str, Path]) -> None:
    """``async_scheduling`` with TP: the launch thread sends each step's
    message and runs rank 0's pass while the engine plans the next; under
    preemption and forks a TP=2 engine streams what a synchronous TP=1
    engine does."""
    path = tp_checkpoints["llama"]
    one = _generate(path, 1, "paged")
    two = _generate(path, 2, "paged", async_scheduling=True)
    assert two["tokens"] == one["tokens"]
    assert two["preemptions"] > 0


def test_tp2_with_speculative_decoding_matches_tp1(tp_checkpoints: dict[str, Path]) -> None:
    """Prompt lookup with TP: each verify pass (a sequence's last token and
    its drafts) runs on every rank, and the room rejected drafts held is
    given back on rank 0's manager alone: TP=2 speculating gives the tokens
    of TP=1 without speculation."""
    path = tp_checkpoints["llama"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    one = _generate(path, 1, "paged")
    two = _generate(path, 2, "paged", speculative_config=spec)
    assert two["tokens"][:4] == one["tokens"][:4]  # the greedy ones (the n=2 one samples)
    assert two["drafts"] > 0


@pytest.mark.parametrize("pool", ["paged", "contiguous"])
def test_tp2_int8_kv_cache_matches_tp1(tp_checkpoints: dict[str, Path], pool: str) -> None:
    """int8 scales are per kv head, so each rank's shard quantizes its heads
    exactly as TP=1 does; copy-on-write and contiguous forks replayed on the
    workers copy the scales with the codes."""
    path = tp_checkpoints["llama"]
    one = _generate(path, 1, pool, kv_cache_dtype="int8")
    two = _generate(path, 2, pool, kv_cache_dtype="int8")
    assert two["tokens"] == one["tokens"]
    assert two["preemptions"] == one["preemptions"]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_tp2_calculated_kv_scales_match_tp1(tp_checkpoints: dict[str, Path], kv_cache_dtype: str) -> None:
    """``calculate_kv_scales`` with TP: every rank runs the calibration pass
    at once (their all-reduces meet) and keeps the scales of its own kv
    heads, which are TP=1's for those heads: the same tokens."""
    path = tp_checkpoints["llama"]
    extra = dict(kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=True)
    one = _generate(path, 1, "paged", **extra)
    two = _generate(path, 2, "paged", **extra)
    assert two["tokens"] == one["tokens"]
    assert two["preemptions"] == one["preemptions"] > 0


def test_tp2_sized_by_memory_share_matches_tp1(tp_checkpoints: dict[str, Path]) -> None:
    """``gpu_memory_utilization`` with TP: each rank sizes its cache from its
    share of the memory (on a CPU the node's ranks split its RAM) and the
    least count wins; with the pool that large, no preemption, same tokens."""
    path = tp_checkpoints["llama"]
    share = dict(num_gpu_blocks=None, gpu_memory_utilization=0.001)
    one = _generate(path, 1, "paged", **share)
    two = _generate(path, 2, "paged", **share)
    assert two["tokens"] == one["tokens"]
    assert "shared by 2 ranks" in two["sized_by"] and "shared by" not in one["sized_by"]
    assert two["blocks"] > 24  # more than the workload's KV demand


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 to run the Triton kernels on a CPU"
)
def test_tp2_decode_graphs_run_on_every_rank_and_are_graph_safe(
    tp_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA graphs with TP, proven on a CPU: ``PAGED_DECODE_GRAPHS=check``
    runs every rank's pure-decode steps through the decode graphs' static
    buffers (padded to the captured sizes, nothing captured) with every op a
    graph could not replay refused (``graph_safety``), each rank once its
    step message has arrived. A rank that took its plain path instead would
    all-reduce tensors of another size than its peer's padded ones: the
    same tokens as TP=1 mean every rank replayed."""
    monkeypatch.setenv("PAGED_DECODE_GRAPHS", "check")  # the workers inherit it
    path, triton = tp_checkpoints["llama"], dict(attention_backend="triton")
    one = _generate(path, 1, "paged", **triton)
    two = _generate(path, 2, "paged", **triton)
    assert two["tokens"] == one["tokens"]
    assert two["preemptions"] == one["preemptions"] > 0
    assert two["graph_steps"] > 0


def test_tp2_int4_kv_cache_matches_tp1(tp_checkpoints: dict[str, Path]) -> None:
    """int4 scales too are per kv head (per channel of a key group, per
    token of a value), so each rank's shard stores what TP=1 stores for its
    heads; forks replayed on the workers copy both scale tensors."""
    path = tp_checkpoints["llama"]
    one = _generate(path, 1, "paged", kv_cache_dtype="int4")
    two = _generate(path, 2, "paged", kv_cache_dtype="int4")
    assert two["tokens"] == one["tokens"]
    assert two["preemptions"] == one["preemptions"]


def _fp8_checkpoint(dense: Path, out: Path) -> Path:
    """A compressed-tensors float-quantized (FP8, per-channel scales) copy of
    ``dense``: each linear weight as float8 e4m3 plus ``weight_scale [N, 1]``."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(dense, out)
    state = load_file(str(dense / "model.safetensors"))
    for key in [k for k in state if k.endswith("proj.weight")]:
        w = state[key].float()
        scale = w.abs().amax(1, keepdim=True) / 448.0
        state[key] = (w / scale).to(torch.float8_e4m3fn)
        state[key.removesuffix("weight") + "weight_scale"] = scale
    save_file(state, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized"}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("family", ["llama", "phi3"])  # Phi-3: q/k/v quantized as one tensor
def test_tp2_quantized_checkpoint_matches_tp1(
    tp_checkpoints: dict[str, Path], tmp_path: Path, family: str
) -> None:
    """Each rank slices the checkpoint's quantized weight with its scales
    (column-parallel: its rows' scales; row-parallel: the whole per-channel
    scales), so TP=2 computes what TP=1 does. (Online quantization instead
    quantizes each rank's shard, as vLLM does: scales then differ by rank.)"""
    path = _fp8_checkpoint(tp_checkpoints[family], tmp_path / "fp8")
    one = _generate(path, 1, "paged")
    two = _generate(path, 2, "paged")
    assert two["tokens"] == one["tokens"]


def test_a_dead_worker_fails_generate_with_a_clear_error(tp_checkpoints: dict[str, Path]) -> None:
    import os
    import signal

    from paged_server.errors import EngineFailedError

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(str(tp_checkpoints["llama"]), tensor_parallel_size=2, **BASE, **POOLS["paged"]) as llm:
        assert llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, use_tqdm=False)
        (worker,) = llm.engine.executor.workers
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        with pytest.raises(EngineFailedError, match=r"paged-tp-rank1 \(pid \d+\) killed by SIGKILL"):
            llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, use_tqdm=False)
        assert any("killed by SIGKILL" in problem for problem in llm.engine.audit())
        with pytest.raises(EngineFailedError):  # stays failed: nothing can step any more
            llm.engine.step()
