"""Property: under every valid config, every accepted request finishes.

The real engine (tiny model, real paged pool) is driven with random
configs (batch size, token budget, chunked prefill on or off, pool size)
and random requests (``n``, prompt length, ``max_tokens``). A request the
engine accepts must never wait forever: the queue head can always
eventually run. A config or request the engine rejects must be rejected
with a ``ValueError`` at construction or submission, never by stalling."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_server.sampling_params import SamplingParams

configs = st.fixed_dictionaries({
    "max_batch_size": st.integers(1, 4),
    "max_num_batched_tokens": st.integers(1, 48),
    "enable_chunked_prefill": st.booleans(),
    "num_gpu_blocks": st.integers(2, 12),
    "max_model_len": st.sampled_from([16, 24, 32]),
    "enable_prefix_caching": st.booleans(),
})
requests = st.lists(
    st.tuples(st.integers(1, 3), st.integers(1, 20), st.integers(1, 5)),  # n, prompt, max_tokens
    min_size=1,
    max_size=4,
)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(config=configs, reqs=requests)
def test_every_accepted_request_finishes(make_engine, run_engine, prompt_of, config, reqs) -> None:
    try:
        engine = make_engine(**config)
    except ValueError:
        return  # an invalid config is refused up front, with a message
    accepted = []
    for i, (n, prompt_len, max_tokens) in enumerate(reqs):
        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=i,
                                ignore_eos=True)
        try:
            engine.add_request(f"r{i}", prompt_of(prompt_len, i), params)
        except ValueError:
            continue  # cannot ever fit (n > max_batch_size, prompt too long for the pool)
        accepted.append((f"r{i}", n, max_tokens))
    run = run_engine(engine, [], max_steps=3000)  # a stall fails here
    for request_id, n, _ in accepted:
        for index in range(n):
            choice = run.choices[(request_id, index)]
            assert choice.finish_reason == "length", (request_id, index, choice)
    assert engine.audit() == []
