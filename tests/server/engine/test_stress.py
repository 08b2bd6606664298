"""200 requests through a pool holding ~10% of their total demand: all
complete, with exactly the tokens of an unpressured run, and no block leaks."""

from __future__ import annotations

from paged_server.sampling_params import SamplingParams


def test_pool_at_ten_percent_of_demand(make_engine, run_engine, prompt_of) -> None:
    requests = []
    for i in range(200):
        params = SamplingParams(max_tokens=3 + i % 6, temperature=0.0, ignore_eos=True)
        if i % 3 == 0:  # some seeded sampling too: recompute must not change it
            params = SamplingParams(max_tokens=4, temperature=0.9, seed=i, ignore_eos=True)
        requests.append((f"s{i}", prompt_of(2 + i % 7, i), params))
    demand = sum(len(p) + prm.max_tokens for _, p, prm in requests)

    roomy = make_engine(max_batch_size=64, max_queue_len=256, num_gpu_blocks=1024)
    ref = run_engine(roomy, requests)

    blocks = demand // 10 // 4  # block_size 4
    tight = make_engine(max_batch_size=64, max_queue_len=256, num_gpu_blocks=blocks)
    run = run_engine(tight, requests)

    assert len(run.choices) == 200
    for key, choice in ref.choices.items():
        got = run.choices[key]
        assert got.finish_reason == "length" and got.error is None, key
        assert got.token_ids == choice.token_ids, key
    m = tight.metrics()
    assert m["num_preemptions_total"] > 0
    assert m["kv_cache_usage_perc"] == 0.0
    assert tight.audit() == [] and roomy.audit() == []
