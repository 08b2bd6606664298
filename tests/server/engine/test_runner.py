"""The model runner against plain causal forward passes of the same model:
whatever the pool, view or batch shape, a row's logits are those of the
sequence run alone without a cache (design 004/000 runner tests)."""

from __future__ import annotations

import pytest
import torch

from paged_server.cache_pool import build_cache_pool
from paged_server.config import EngineConfig
from paged_server.runner import ModelRunner
from paged_server.sampling_params import SamplingParams
from paged_server.sequence import Request, Sequence, SequenceStatus


def no_cache_logits(loaded, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of ``tokens`` with plain causal attention."""
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        return loaded.model(ids, torch.arange(len(tokens)).unsqueeze(0), None)[0]


def make_runner(loaded, backend: str, **kw):
    config = EngineConfig(
        kv_cache_backend=backend, block_size=4, max_seq_len=64, max_batch_size=4, **kw
    )
    pool, capacity = build_cache_pool(
        config, loaded.config, torch.float32, torch.device("cpu"), "ref"
    )
    return ModelRunner(loaded.model, pool, torch.device("cpu")), pool, capacity


def admit(pool, tokens: list[int]) -> Sequence:
    request = Request("r", None, list(tokens), SamplingParams(), 0.0)
    seq = Sequence(0, request, 0, list(tokens), torch.Generator(), None)  # type: ignore[arg-type]
    seq.slot, seq.num_computed = pool.allocate_sequence(tokens)
    seq.prefill_len, seq.status = len(tokens), SequenceStatus.RUNNING
    return seq


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
def test_prefill_chunks_and_decode_match_an_uncached_forward(
    tiny_loaded, prompt_of, backend
) -> None:
    runner, pool, _ = make_runner(tiny_loaded, backend, enable_prefix_caching=False)
    long, short = prompt_of(11, 1), prompt_of(5, 2)
    a, b = admit(pool, long), admit(pool, short)
    # Batched prefill of different lengths (right padding), then the rest of A alone.
    logits = runner.prefill([(a, 6), (b, 5)])
    assert pool.get_seq_len(a.slot) == 6 and pool.get_seq_len(b.slot) == 5
    torch.testing.assert_close(logits[1], no_cache_logits(tiny_loaded, short)[-1])
    logits = runner.prefill([(a, 5)])
    assert pool.get_seq_len(a.slot) == 11 and not a.is_prefilling
    torch.testing.assert_close(logits[0], no_cache_logits(tiny_loaded, long)[-1])
    # Two decode steps with made-up next tokens, at each sequence's own position.
    for step_tokens in ([7, 8], [9, 10]):
        for seq, tok in zip((a, b), step_tokens, strict=True):
            seq.token_ids.append(tok)
            pool.append_token(seq.slot, tok)
        logits = runner.decode([a, b])
        for i, seq in enumerate((a, b)):
            assert pool.get_seq_len(seq.slot) == len(seq.token_ids)
            torch.testing.assert_close(logits[i], no_cache_logits(tiny_loaded, seq.token_ids)[-1])


def test_paged_prefill_allocates_blocks_and_free_returns_them(tiny_loaded, prompt_of) -> None:
    runner, pool, capacity = make_runner(tiny_loaded, "paged", num_gpu_blocks=16)
    assert pool.free_token_capacity() == capacity.tokens == 64
    seq = admit(pool, prompt_of(9, 3))
    assert pool.free_token_capacity() == 64 - 3 * 4  # ceil(9 / 4) blocks
    runner.prefill([(seq, 9)])
    pool.free_slot(seq.slot)
    assert pool.free_token_capacity() == 64
    assert pool.audit() == []


def test_contiguous_pool_reports_no_token_capacity(tiny_loaded) -> None:
    _, pool, capacity = make_runner(tiny_loaded, "contiguous")
    assert pool.free_token_capacity() is None
    assert capacity.num_slots == 4 and capacity.tokens == 4 * 64


def test_prefix_hit_starts_positions_at_the_cached_length(tiny_loaded, prompt_of) -> None:
    runner, pool, _ = make_runner(tiny_loaded, "paged")
    prompt = prompt_of(10, 4)
    first = admit(pool, prompt)
    runner.prefill([(first, 10)])
    second = admit(pool, prompt[:8] + [5, 6, 7])
    assert second.num_computed == 8  # two full blocks from the cache
    logits = runner.prefill([(second, 3)])
    torch.testing.assert_close(logits[0], no_cache_logits(tiny_loaded, second.token_ids)[-1])


def test_pool_sizing_from_config(tiny_loaded) -> None:
    c = tiny_loaded.config
    block_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * 4  # fp32, block_size 4
    _, _, cap = make_runner(tiny_loaded, "paged")
    assert cap.num_blocks == 4 * 64 // 4  # max_batch_size * max_seq_len / block_size
    _, _, cap = make_runner(tiny_loaded, "paged", kv_cache_memory_bytes=10 * block_bytes + 7)
    assert cap.num_blocks == 10 and cap.tokens == 40
    _, _, cap = make_runner(tiny_loaded, "paged", num_gpu_blocks=3, kv_cache_memory_bytes=1 << 30)
    assert cap.num_blocks == 3  # an explicit block count wins
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        make_runner(tiny_loaded, "paged", kv_cache_memory_bytes=block_bytes - 1)
    # contiguous: rows of max_seq_len (64) tokens, at most max_batch_size of them
    _, _, cap = make_runner(tiny_loaded, "contiguous", kv_cache_memory_bytes=16 * 3 * block_bytes)
    assert cap.num_slots == 3
    _, _, cap = make_runner(tiny_loaded, "contiguous", kv_cache_memory_bytes=1 << 30)
    assert cap.num_slots == 4
