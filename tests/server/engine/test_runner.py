"""A step through the worker (``step_batch.run_step``: the flat batch, the
KV cache manager's layout, ``Worker.execute``) against plain causal forward
passes of the same model: whatever the cache or the mix of work in a step,
a sequence's logits are those of the sequence run alone without a cache,
and only real tokens go through the model."""

from __future__ import annotations

import pytest
import torch

from paged_server.config import EngineConfig
from paged_server.engine.core.step_batch import run_step
from paged_server.engine.kv.pool_factory import build_kv_manager, pool_capacity
from paged_server.engine.request.sequence import Request, Sequence, SequenceStatus
from paged_server.engine.worker.worker import Worker
from paged_server.sampling_params import SamplingParams


def no_cache_logits(loaded, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of ``tokens`` with plain causal attention."""
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        return loaded.model(ids, torch.arange(len(tokens)).unsqueeze(0), None)[0]


def make_runner(loaded, backend: str, **kw):
    """A worker with its cache, the KV cache manager over it, the capacity."""
    config = EngineConfig(
        **{"kv_cache_backend": backend, "block_size": 4, "max_model_len": 64, "max_batch_size": 4}
        | kw
    ).resolve(loaded.config, torch.device("cpu"), torch.float32)
    worker = Worker(config, loaded=loaded)
    num_blocks, sized_by = worker.available_blocks()
    worker.init_cache(num_blocks)
    spec = worker.kv_spec()
    return worker, build_kv_manager(config, spec, num_blocks), pool_capacity(config, spec, num_blocks, sized_by)


def admit(pool, tokens: list[int]) -> Sequence:
    request = Request("r", None, list(tokens), SamplingParams(), 0.0)
    seq = Sequence(0, request, 0, list(tokens), torch.Generator(), None)  # type: ignore[arg-type]
    seq.pool_seq_id, seq.num_computed_tokens = pool.allocate_sequence(tokens)
    seq.status = SequenceStatus.RUNNING
    return seq


def step(runner, pool, scheduled):
    """Run and commit one step as the engine does; logits by sequence."""
    out = run_step(runner, pool, scheduled)
    for seq, n in scheduled:
        seq.num_computed_tokens += n
        pool.mark_computed(seq.pool_seq_id, seq.num_computed_tokens)
    return {id(scheduled[i][0]): out.logits[j] for j, i in enumerate(out.sampled)}


def grow(pool, seq: Sequence, token: int) -> None:
    """A sampled token: append it and reserve its room, as the scheduler does."""
    seq.token_ids.append(token)
    pool.append_token(seq.pool_seq_id, token)


def fork(pool, parent: Sequence) -> Sequence:
    child = Sequence(1, parent.request, 1, list(parent.token_ids), torch.Generator(), None)  # type: ignore[arg-type]
    child.pool_seq_id = pool.fork_seq(parent.pool_seq_id)
    child.num_computed_tokens = parent.num_computed_tokens
    child.status = SequenceStatus.RUNNING
    return child


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
def test_mixed_step_matches_each_sequence_alone(tiny_loaded, prompt_of, backend) -> None:
    """One pass holding decodes, two prefill chunks (one completing a prompt,
    one not), a prefix-cache hit and a fork gives each sequence the logits
    of an uncached forward of its own tokens."""
    runner, pool, _ = make_runner(tiny_loaded, backend, max_batch_size=5)
    a = admit(pool, prompt_of(11, 1))
    b = admit(pool, prompt_of(9, 2))
    step(runner, pool, [(a, 11), (b, 5)])
    e = fork(pool, a)  # shares every block of a's prompt, the partial last one too
    grow(pool, a, 7)  # copy-on-write: a writes into a private copy of that block
    grow(pool, e, 8)
    c = admit(pool, prompt_of(13, 3))
    d = admit(pool, a.token_ids[:8] + prompt_of(3, 4))  # paged: 2 blocks from the cache
    if backend == "paged":
        assert d.num_computed_tokens == 8
    scheduled = [(b, 4), (a, 1), (c, 6), (e, 1), (d, d.num_tokens - d.num_computed_tokens)]
    logits = step(runner, pool, scheduled)
    assert set(logits) == {id(a), id(b), id(d), id(e)}  # c is mid-prompt: no logits
    for seq in (a, b, d, e):
        want = no_cache_logits(tiny_loaded, seq.token_ids)[-1]
        torch.testing.assert_close(logits[id(seq)], want, atol=1e-5, rtol=1e-5)
    # c's first chunk is in the cache: the rest of its prompt continues from it.
    logits = step(runner, pool, [(c, 7)])
    torch.testing.assert_close(
        logits[id(c)], no_cache_logits(tiny_loaded, c.token_ids)[-1], atol=1e-5, rtol=1e-5
    )
    assert pool.audit() == []


def test_no_padding_reaches_the_linear_layers(tiny_loaded, prompt_of) -> None:
    """Every projection sees exactly the step's tokens; the LM head only the
    rows that are sampled."""
    runner, pool, _ = make_runner(tiny_loaded, "paged")
    rows: dict[str, list[int]] = {"qkv_proj": [], "down_proj": [], "lm_head": []}
    model = tiny_loaded.model
    hooks = [
        model.model.layers[0].self_attn.qkv_proj.register_forward_hook(
            lambda m, i, o: rows["qkv_proj"].append(i[0].shape[0])
        ),
        model.model.layers[-1].mlp.down_proj.register_forward_hook(
            lambda m, i, o: rows["down_proj"].append(i[0].shape[0])
        ),
        model.lm_head.register_forward_hook(lambda m, i, o: rows["lm_head"].append(i[0].shape[0])),
    ]
    try:
        a, b, c = (admit(pool, prompt_of(n, i)) for i, n in enumerate((3, 17, 6)))
        step(runner, pool, [(a, 3), (b, 10), (c, 6)])
        grow(pool, a, 5)
        grow(pool, c, 6)
        step(runner, pool, [(a, 1), (b, 7), (c, 1)])
    finally:
        for h in hooks:
            h.remove()
    assert rows["qkv_proj"] == rows["down_proj"] == [19, 9]
    assert rows["lm_head"] == [2, 3]  # a and c, then a, b and c


def test_a_step_without_reserved_room_is_refused(tiny_loaded, prompt_of) -> None:
    runner, pool, _ = make_runner(tiny_loaded, "paged")
    a = admit(pool, prompt_of(4, 1))
    step(runner, pool, [(a, 4)])
    a.token_ids.append(9)  # sampled but not reserved (the scheduler's job)
    with pytest.raises(RuntimeError, match="reserve first"):
        run_step(runner, pool, [(a, 1)])


def test_paged_prefill_allocates_blocks_and_free_returns_them(tiny_loaded, prompt_of) -> None:
    runner, pool, capacity = make_runner(tiny_loaded, "paged", num_gpu_blocks=16)
    assert pool.free_token_capacity() == capacity.tokens == 64
    seq = admit(pool, prompt_of(9, 3))
    assert pool.free_token_capacity() == 64 - 3 * 4  # ceil(9 / 4) blocks
    step(runner, pool, [(seq, 9)])
    pool.free_seq(seq.pool_seq_id)
    assert pool.free_token_capacity() == 64
    assert pool.audit() == []


def test_contiguous_pool_reports_no_token_capacity(tiny_loaded) -> None:
    _, pool, capacity = make_runner(tiny_loaded, "contiguous")
    assert pool.free_token_capacity() is None
    assert capacity.num_rows == 4 and capacity.tokens == 4 * 64


def test_prefix_hit_starts_positions_at_the_cached_length(tiny_loaded, prompt_of) -> None:
    runner, pool, _ = make_runner(tiny_loaded, "paged")
    prompt = prompt_of(10, 4)
    first = admit(pool, prompt)
    step(runner, pool, [(first, 10)])
    second = admit(pool, prompt[:8] + [5, 6, 7])
    assert second.num_computed_tokens == 8  # two full blocks from the cache
    logits = step(runner, pool, [(second, 3)])
    want = no_cache_logits(tiny_loaded, second.token_ids)[-1]
    torch.testing.assert_close(logits[id(second)], want)


def test_pool_sizing_from_config(tiny_loaded) -> None:
    c = tiny_loaded.config
    block_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * 4  # fp32, block_size 4
    _, _, cap = make_runner(tiny_loaded, "paged")
    assert cap.num_blocks == 4 * 64 // 4  # max_batch_size * max_model_len / block_size
    _, _, cap = make_runner(tiny_loaded, "paged", kv_cache_memory_bytes=10 * block_bytes + 7)
    assert cap.num_blocks == 10 and cap.tokens == 40
    _, _, cap = make_runner(tiny_loaded, "paged", num_gpu_blocks=3, kv_cache_memory_bytes=1 << 30)
    assert cap.num_blocks == 3  # an explicit block count wins
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        make_runner(tiny_loaded, "paged", kv_cache_memory_bytes=block_bytes - 1)
    # contiguous: rows of max_model_len (64) tokens, at most max_batch_size of them
    _, _, cap = make_runner(tiny_loaded, "contiguous", kv_cache_memory_bytes=16 * 3 * block_bytes)
    assert cap.num_rows == 3
    _, _, cap = make_runner(tiny_loaded, "contiguous", kv_cache_memory_bytes=1 << 30)
    assert cap.num_rows == 4
