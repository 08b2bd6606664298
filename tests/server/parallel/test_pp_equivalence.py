"""PP=2 gives the same tokens as one rank, and each stage's pool holds only its layers.

Real worker processes over loopback gloo, tiny random checkpoints made by
transformers (``conftest.tp_checkpoints``, two layers: one per stage). The
workload is the TP tests' one: shared prefixes (prefix-cache hits), prompts
longer than the step budget (chunked prefill), more KV demand than the pool
holds (preemption and recompute) and an ``n=2`` request (copy-on-write
forks replayed on every stage). Steps of up to four sequences, prefill
chunks beside decodes, run as two micro-batches by default (one per stage).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.server.parallel.test_tp_equivalence import BASE, POOLS, _workload

from paged_server.config import EngineConfig
from paged_server.entrypoints.llm import LLM
from paged_server.parallel.pipeline import MICRO_BATCHES_ENV, micro_batch_count, split_batch

pytestmark = pytest.mark.timeout(300)


def _generate(path: Path, tp: int = 1, pp: int = 1, **extra: Any) -> dict[str, Any]:
    prompts, params = _workload()
    config = {**BASE, **POOLS["paged"], **extra}
    with LLM(str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp, **config) as llm:
        engine = llm.engine
        steps: list[list[int]] = []  # each pass's token counts, in the runner's order (decodes first)
        execute = engine._forward

        def recorded(scheduled: Any) -> Any:
            lens = [n for _, n in scheduled]
            steps.append(sorted(lens, key=lambda n: n != 1))
            return execute(scheduled)

        engine._forward = recorded
        results = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        metrics = engine.metrics()
        assert engine.audit() == []
        out = {
            "tokens": [[c.token_ids for c in r.outputs] for r in results],
            "preemptions": metrics["num_preemptions_total"],
            "prefix_hits": metrics["prefix_cache_hits_total"],
            "summary": engine.parallel_summary(),
            "sends": engine.executor.group.counts.sends if pp * tp > 1 else 0,
            "steps": steps,
            "sized_by": engine.capacity.sized_by,
            "blocks": engine.capacity.num_blocks,
            "drafts": metrics["spec_decode_num_draft_tokens_total"],
        }
        workers = list(getattr(engine.executor, "workers", []))
    assert all(not w.is_alive() for w in workers), "workers must exit with the LLM"
    return out


def test_pp2_with_speculative_decoding_matches_one_rank(tp_checkpoints: dict[str, Path]) -> None:
    """A verify pass (a sequence's last token and its drafts) is one more
    prompt-like row through both stages: PP=2 speculating gives one rank's
    greedy tokens without speculation."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    one = _generate(tp_checkpoints["llama"])
    two = _generate(tp_checkpoints["llama"], pp=2, speculative_config=spec)
    assert two["tokens"][:4] == one["tokens"][:4]  # the greedy ones (the n=2 one samples)
    assert two["drafts"] > 0


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_pp2_matches_one_rank_token_for_token(tp_checkpoints: dict[str, Path], family: str) -> None:
    path = tp_checkpoints[family]
    one = _generate(path)
    two = _generate(path, pp=2)
    assert two["tokens"] == one["tokens"]
    assert two["preemptions"] == one["preemptions"] > 0
    assert two["prefix_hits"] == one["prefix_hits"] > 0
    assert "pipeline_parallel_size=2: layers split 1+1" in two["summary"]
    # Rank 0 sends each micro-batch's activations on: two for every step of
    # two sequences or more, among them steps of four and steps mixing
    # decodes with prefill chunks.
    assert two["sends"] == sum(len(split_batch(lens, 2)) - 1 for lens in two["steps"])
    assert any(len(lens) == 4 for lens in two["steps"])
    assert any(len(lens) >= 3 and lens[0] == 1 and lens[-1] > 1 for lens in two["steps"])
    assert two["sends"] > len(two["steps"])


def test_pp2_calculated_kv_scales_match_one_rank(tp_checkpoints: dict[str, Path]) -> None:
    """``calculate_kv_scales`` with PP: the calibration pass runs through the
    stages (rank 0 sends its activations on), and each stage keeps the scales
    of its own layers: the tokens of one rank with calculated scales."""
    path = tp_checkpoints["llama"]
    extra = dict(kv_cache_dtype="int8", calculate_kv_scales=True)
    one = _generate(path, **extra)
    two = _generate(path, pp=2, **extra)
    assert two["tokens"] == one["tokens"]
    assert two["preemptions"] == one["preemptions"] > 0


def test_pp2_sized_by_memory_share_matches_one_rank(tp_checkpoints: dict[str, Path]) -> None:
    """``gpu_memory_utilization`` with PP: each stage sizes its own layers'
    cache from its share of this CPU's RAM, the least count wins."""
    path = tp_checkpoints["llama"]
    share = dict(num_gpu_blocks=None, gpu_memory_utilization=0.001)
    one = _generate(path, **share)
    two = _generate(path, pp=2, **share)
    assert two["tokens"] == one["tokens"]
    assert "shared by 2 ranks" in two["sized_by"]
    assert two["blocks"] > 24


@pytest.mark.parametrize("micro_batches", ["1", "3"])
def test_any_number_of_micro_batches_gives_the_same_tokens(
    tp_checkpoints: dict[str, Path], micro_batches: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One micro-batch (the synchronous schedule) and more micro-batches
    than stages give PP=1's tokens too."""
    path = tp_checkpoints["llama"]
    one = _generate(path)
    monkeypatch.setenv(MICRO_BATCHES_ENV, micro_batches)
    two = _generate(path, pp=2)
    assert two["tokens"] == one["tokens"]
    assert two["preemptions"] == one["preemptions"] > 0
    count = int(micro_batches)
    assert two["sends"] == sum(min(count, len(lens)) for lens in two["steps"])


def test_steps_split_into_whole_sequences_of_about_equal_tokens() -> None:
    assert split_batch([1, 1, 1, 1], 2) == [0, 2, 4]
    assert split_batch([1] * 15 + [100], 2) == [0, 15, 16]  # decodes, then the chunk alone
    assert split_batch([10, 1, 1, 1], 2) == [0, 1, 4]
    assert split_batch([3] * 6, 3) == [0, 2, 4, 6]
    assert split_batch([1, 1, 10], 3) == [0, 1, 2, 3]  # every run holds a sequence
    assert split_batch([5, 5, 5], 4) == [0, 1, 2, 3]  # never more runs than sequences
    assert split_batch([7], 2) == [0, 1] and split_batch([4, 4], 1) == [0, 2]


def test_a_bad_micro_batch_count_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MICRO_BATCHES_ENV, "0")
    with pytest.raises(ValueError, match=r"PAGED_PP_MICRO_BATCHES must be an integer >= 1, got '0'"):
        micro_batch_count(2)
    monkeypatch.delenv(MICRO_BATCHES_ENV)
    assert micro_batch_count(4) == 4  # one per stage by default


def test_stage_split_is_vllms() -> None:
    from paged_server.models.pipeline_parallel import PipelineStage, stage_layers

    assert [len(stage_layers(26, r, 4)) for r in range(4)] == [6, 7, 7, 6]  # remainder before the last
    assert [stage_layers(5, r, 2) for r in range(2)] == [range(0, 3), range(3, 5)]
    last = PipelineStage(1, 2, 4)
    assert last.holds_weight("model.layers.3.mlp.down_proj.weight", tied=False)
    assert not last.holds_weight("model.layers.1.mlp.down_proj.weight", tied=False)
    assert last.holds_weight("lm_head.weight", tied=False) and last.holds_weight("model.norm.weight", tied=False)
    assert not last.holds_weight("model.embed_tokens.weight", tied=False)
    assert last.holds_weight("model.embed_tokens.weight", tied=True)  # the tied LM head
    assert not PipelineStage(0, 2, 4).holds_weight("lm_head.weight", tied=False)


def test_uneven_split_with_int8_kv_and_logprobs_matches_one_rank(tmp_path: Path) -> None:
    """Three layers over two stages (2+1): the first stage has more cache
    layers and sets the block count for both; int8 KV per-token scales live
    at each stage's cache layers; prompt and sample logprobs come back from
    the last stage's logits, each micro-batch's put back in the step's row
    order (sampled rows first, then scored prompt rows). Micro-batches
    change the matmuls' shapes, so values differ by float rounding (~1e-5
    here with a float cache), which an int8 code now and then rounds the
    other way: hence 1e-3, not 1e-4 (one micro-batch matches to 1e-4)."""
    import torch
    from tests.server.parallel.conftest import _COMMON, VOCAB
    from transformers import LlamaConfig, LlamaForCausalLM

    from paged_server.default_model.tokenizer_builder import build_tokenizer
    from paged_server.sampling_params import SamplingParams

    torch.manual_seed(0)
    config = LlamaConfig(num_key_value_heads=2, head_dim=16, **{**_COMMON, "num_hidden_layers": 3})
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    build_tokenizer(VOCAB).save(str(tmp_path / "tokenizer.json"))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    prompts = [[5, 6, 7, 8, 9, 10], [20, 21, 22, 23, 24, 25, 26, 27], [40, 41, 42, 43, 44]]
    runs = []
    for pp in (1, 2):
        with LLM(str(tmp_path), pipeline_parallel_size=pp, kv_cache_dtype="int8",
                 **BASE, **POOLS["paged"]) as llm:  # fmt: skip
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            if pp == 2:
                assert "layers split 2+1" in (llm.engine.parallel_summary() or "")
            runs.append(outs)
    for one, two in zip(*runs, strict=True):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
        for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[k] - b[k]) < 1e-3 for k in a)
        assert two.outputs[0].logprobs == pytest.approx(one.outputs[0].logprobs, abs=1e-3)
        for a, b in zip(one.outputs[0].top_logprobs, two.outputs[0].top_logprobs, strict=True):
            assert a.keys() == b.keys()


def test_bad_pipeline_settings_are_refused_in_one_line(tp_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"pipeline_parallel_size > 1 needs kv_cache_backend='paged'"):
        EngineConfig(pipeline_parallel_size=2, kv_cache_backend="contiguous").validate()
    with pytest.raises(ValueError, match=r"pipeline_parallel_size: must be an integer >= 1, got 0"):
        EngineConfig(pipeline_parallel_size=0).validate()
    # Three stages for two layers: refused before any worker process starts.
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(3\) exceeds the model's 2 layers"):
        LLM(str(tp_checkpoints["llama"]), pipeline_parallel_size=3, **BASE, **POOLS["paged"])


def test_tp2_by_pp2_matches_one_rank_on_four_ranks(tp_checkpoints: dict[str, Path]) -> None:
    """Four ranks: two stages of two tensor-parallel ranks (rank = stage * 2 + tp rank)."""
    path = tp_checkpoints["qwen3"]
    one = _generate(path)
    four = _generate(path, tp=2, pp=2)
    assert four["tokens"] == one["tokens"]
    assert four["preemptions"] == one["preemptions"]
    assert four["sends"] > len(four["steps"])  # in micro-batches
    assert "tensor_parallel_size=2: each rank holds 1 of 2 KV heads" in four["summary"]
    assert "pipeline_parallel_size=2: layers split 1+1" in four["summary"]


def _pool(path: Path, stage: int, stages: int, budget: int) -> tuple[int, int]:
    """(KV tokens, pool bytes) of stage ``stage``'s pool at ``budget`` bytes per rank."""
    import torch

    from paged_server.engine.kv.pool_factory import build_cache_pool
    from paged_server.models.loader import read_model_config
    from paged_server.models.pipeline_parallel import PipelineStage

    config = EngineConfig(**{**BASE, **POOLS["paged"], "num_gpu_blocks": None,
                             "kv_cache_memory_bytes": budget})  # fmt: skip
    pool, capacity = build_cache_pool(
        config, read_model_config(path), torch.float32, torch.device("cpu"), "ref",
        pp=PipelineStage(stage, stages),
    )  # fmt: skip
    assert capacity.kv_bytes == pool.kv_bytes()  # type: ignore[attr-defined]
    return capacity.tokens, pool.kv_bytes()  # type: ignore[attr-defined]


def test_each_stage_holds_twice_the_tokens_at_equal_bytes_per_rank(
    tp_checkpoints: dict[str, Path],
) -> None:
    """A stage's pool stores its layers only: at PP=2 the same bytes per
    rank hold 2x the tokens (the measured numbers are in the report)."""
    budget = 256 * 1024
    path = tp_checkpoints["llama"]
    tokens1, bytes1 = _pool(path, 0, 1, budget)
    stages = [_pool(path, r, 2, budget) for r in range(2)]
    assert stages[0] == stages[1]  # the same blocks on both stages
    tokens2, bytes2 = stages[0]
    assert bytes1 <= budget and bytes2 <= budget
    assert tokens2 == 2 * tokens1, (tokens1, tokens2)
    # Through the engine: rank 0's pool as serving sees it.
    with LLM(str(path), pipeline_parallel_size=2, **{**BASE, **POOLS["paged"],
             "num_gpu_blocks": None, "kv_cache_memory_bytes": budget}) as llm:  # fmt: skip
        assert llm.engine.capacity.tokens == tokens2
        assert llm.engine.capacity.kv_bytes == bytes2


def test_a_dead_stage_fails_generate_with_a_clear_error(tp_checkpoints: dict[str, Path]) -> None:
    import os
    import signal

    from paged_server.errors import EngineFailedError
    from paged_server.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    path = str(tp_checkpoints["llama"])
    with LLM(path, pipeline_parallel_size=2, **BASE, **POOLS["paged"]) as llm:
        assert llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, use_tqdm=False)
        (worker,) = llm.engine.executor.workers
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        # named by what it is: a pipeline stage's worker, not a tensor-parallel one
        dead = r"pipeline-parallel worker paged-tp-rank1 \(pid \d+\) killed by SIGKILL"
        with pytest.raises(EngineFailedError, match=dead):
            llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, use_tqdm=False)
        with pytest.raises(EngineFailedError):  # stays failed
            llm.engine.step()
