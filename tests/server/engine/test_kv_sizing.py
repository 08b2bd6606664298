"""KV pool sizing: by a share of memory (``gpu_memory_utilization``), by an
explicit budget or block count, and the CPU default; the pool holds exactly
the tokens the start-up line claims, and a model that leaves no room
refuses to start with a clear message."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from paged_server.config import EngineConfig
from paged_server.engine.core.llm_engine import LLMEngine
from paged_server.engine.kv import kv_sizing
from paged_server.entrypoints.openai.app import ServerSettings
from paged_server.entrypoints.openai.server import startup_line

# tiny model (conftest): 2 layers x 2 kv heads x head_dim 16, K and V, float32
TOKEN_BYTES = 2 * 2 * 2 * 16 * 4


def fill(pool, block_size: int) -> int:
    """Tokens the pool actually holds: one-block prompts until it says no."""
    held = 0
    while pool.can_allocate_sequence(list(range(1, block_size + 1))):
        pool.allocate_sequence(list(range(1, block_size + 1)))
        held += block_size
    return held


def test_cpu_share_of_available_ram_holds_what_the_startup_line_claims(
    make_engine, monkeypatch
) -> None:
    monkeypatch.setattr(kv_sizing, "available_cpu_memory", lambda: 100_000)
    engine = make_engine(gpu_memory_utilization=0.5, max_model_len=64)
    want_blocks = 50_000 // (TOKEN_BYTES * 4)
    assert engine.capacity.num_blocks == want_blocks
    line = startup_line(engine, ServerSettings(model_name="tiny"), "http://127.0.0.1:1")
    m = re.search(r"capacity (\d+) tokens in (\d+) blocks of 4 \(sized by ([^)]*)\)", line)
    assert m, line
    assert int(m[1]) == want_blocks * 4 and "--gpu-memory-utilization 0.5" in m[3]
    assert "MemAvailable" in m[3]
    assert fill(engine.kv_manager, 4) == int(m[1])


def test_real_available_ram_sizes_the_pool(make_engine) -> None:
    before = kv_sizing.available_cpu_memory()
    # ~8 blocks of this machine's free RAM, whatever it is (a fixed share of
    # 1e-7 left less than one block once free RAM fell below ~20 GiB).
    share = TOKEN_BYTES * 4 * 8 / before
    engine = make_engine(gpu_memory_utilization=share, max_model_len=16)
    after = kv_sizing.available_cpu_memory()
    blocks = engine.capacity.num_blocks
    lo, hi = sorted((before, after))
    assert int(lo * 0.9 * share) // (TOKEN_BYTES * 4) <= blocks
    assert blocks <= int(hi * 1.1 * share) // (TOKEN_BYTES * 4) + 1


def test_no_room_refuses_to_start(make_engine, monkeypatch) -> None:
    monkeypatch.setattr(kv_sizing, "available_cpu_memory", lambda: 3000)
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization: no room for the KV cache"):
        make_engine(gpu_memory_utilization=0.5)


def test_explicit_sizes_win_and_the_cpu_default_is_unchanged(make_engine, monkeypatch) -> None:
    monkeypatch.setattr(kv_sizing, "available_cpu_memory", lambda: 100_000)
    engine = make_engine(gpu_memory_utilization=0.5, num_gpu_blocks=7)
    assert engine.capacity.num_blocks == 7 and engine.capacity.sized_by == "--num-gpu-blocks"
    engine = make_engine(gpu_memory_utilization=0.5, kv_cache_memory_bytes=TOKEN_BYTES * 4 * 5)
    assert engine.capacity.num_blocks == 5
    engine = make_engine()  # CPU default: max_batch_size x max_model_len
    assert engine.capacity.tokens == 8 * 128 and "CPU default" in engine.capacity.sized_by


@pytest.mark.parametrize("share", [0.0, 1.5, True])
def test_bad_share_is_rejected(make_engine, share) -> None:
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization: must be a fraction"):
        make_engine(gpu_memory_utilization=share)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_default_profiles_and_sizes_from_free_memory(tiny_model_dir) -> None:
    from paged_server.config import EngineConfig
    from paged_server.engine.core.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cuda", block_size=16,
                                    max_model_len=128, max_batch_size=8))
    free, total = torch.cuda.mem_get_info()
    assert "--gpu-memory-utilization 0.9" in engine.capacity.sized_by
    pool_bytes = engine.capacity.tokens * TOKEN_BYTES // 2  # bfloat16 on CUDA
    assert pool_bytes <= 0.9 * total and engine.capacity.num_blocks > 0
    del engine
    with pytest.raises(ValueError, match="no room for the KV cache"):
        LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cuda", max_model_len=128,
                               max_batch_size=8, gpu_memory_utilization=0.001))


def test_an_explicit_size_is_not_a_memory_share() -> None:
    """``num_gpu_blocks`` wins over ``gpu_memory_utilization`` (tensor and
    pipeline parallelism size by memory share too: tests/server/parallel)."""
    from paged_server.config import EngineConfig

    assert not kv_sizing.sizes_by_memory_share(
        EngineConfig(device="cpu", gpu_memory_utilization=0.5, num_gpu_blocks=8), torch.device("cpu")
    )


def small_pool(loaded, num_gpu_blocks: int) -> LLMEngine:
    config = EngineConfig(max_model_len=64, block_size=4, max_batch_size=2, device="cpu",
                          attention_backend="ref", num_gpu_blocks=num_gpu_blocks)
    return LLMEngine(config, loaded)


def test_a_pool_that_holds_no_request_refuses_to_start(tiny_hybrid_loaded, run_engine,
                                                       greedy) -> None:
    """Issue 53: the shortest request takes a block in each of the hybrid
    model's 4 KV cache groups; 4 blocks (one the null block) hold none, and
    the engine says so in one line instead of refusing every request."""
    with pytest.raises(ValueError) as refused:
        small_pool(tiny_hybrid_loaded, 4)
    line = str(refused.value)
    assert "\n" not in line and "hold no request" in line
    assert "its 3 blocks (4 less the null block" in line
    assert "needs 4, one in each of the model's 4 KV cache groups" in line
    assert "raise --num-gpu-blocks to at least 5" in line
    engine = small_pool(tiny_hybrid_loaded, 5)  # as the line says: it serves that request
    run = run_engine(engine, [("short", [5], greedy(max_tokens=1))])
    assert run.choices[("short", 0)].finish_reason == "length"


@pytest.mark.parametrize("model", ["tiny_loaded", "tiny_hybrid_loaded"])
def test_a_pool_short_of_max_model_len_warns_with_the_requests_it_holds(
    request, model, greedy, caplog
) -> None:
    """The warning's numbers are the edges of what submission accepts, and
    its advice silences it."""
    loaded = request.getfixturevalue(model)
    with caplog.at_level(logging.WARNING, logger="paged_server.engine.core.llm_engine"):
        engine = small_pool(loaded, 9)
    (line,) = [r.getMessage() for r in caplog.records if "cannot hold every" in r.getMessage()]
    assert "max_model_len 64" in line
    fits = int(re.search(r"any of up to (\d+) tokens", line).group(1))
    blocks = int(re.search(r"raise --num-gpu-blocks to (\d+)", line).group(1))
    assert f"lower --max-model-len to {fits}" in line
    engine.add_request("edge", list(range(3, 3 + fits - 1)), greedy(max_tokens=1))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("past", list(range(3, 3 + fits)), greedy(max_tokens=1))
    for num_gpu_blocks, warned in ((blocks - 1, True), (blocks, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="paged_server.engine.core.llm_engine"):
            small_pool(loaded, num_gpu_blocks)
        assert any("cannot hold every" in r.getMessage() for r in caplog.records) == warned


@pytest.mark.parametrize("model", ["tiny_loaded", "tiny_sliding_loaded", "tiny_hybrid_loaded"])
@pytest.mark.parametrize("num_gpu_blocks", [5, 6, 9, 16])
def test_the_longest_prompt_is_what_one_sequence_can_take(request, model, num_gpu_blocks) -> None:
    """The warm-up's throwaway prefill is as long as ``longest_prompt`` (no
    step computes more): the pool takes a sequence of that many tokens and
    not one more."""
    engine = small_pool(request.getfixturevalue(model), num_gpu_blocks)
    longest = engine.capacity.longest_prompt
    assert engine.kv_manager.can_allocate_sequence(list(range(3, 3 + longest)))
    assert not engine.kv_manager.can_allocate_sequence(list(range(3, 4 + longest)))
