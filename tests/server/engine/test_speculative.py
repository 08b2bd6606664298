"""Speculative decoding (``speculative_config``, n-gram prompt lookup): every
answer stays the target model's. Greedy output is identical token for token
with and without speculation, under chunked prefill, prefix hits and
preemption, on both pools; sampled output follows the model's distribution
(rejection sampling, checked statistically); a seeded request gives the same
text whatever its neighbours; the KV cache keeps no rejected draft."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from paged_server.engine.sample.sampler import SamplingRow, sampling_distribution
from paged_server.engine.speculative.acceptance_gate import AcceptanceGate
from paged_server.engine.speculative.ngram import NgramProposer
from paged_server.engine.speculative.step_cost import (
    EXPLORE_EVERY,
    MAX_EXPLORE_EVERY,
    StepCost,
    bucket,
    expected_tokens,
)
from paged_server.engine.speculative.verify import StepChecks, _reject, verify
from paged_server.sampling_params import SamplingParams
from paged_server.speculative_config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


# -- the config, as vLLM takes it ---------------------------------------------------
def test_config_takes_vllms_keys_and_defaults() -> None:
    both = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    one = SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (one.method, one.prompt_lookup_min, one.prompt_lookup_max) == ("ngram", 4, 4)
    off = SpeculativeConfig.parse({**NGRAM, "disable_by_batch_size": 8, "disable_log_stats": False})
    assert off.speculates(7) and not off.speculates(8)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"method": "eagle", "model": "x", "num_speculative_tokens": 2}, "method 'eagle' is not built"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, '"method": "draft_model" needs "model"'),
        ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1, got None"),
        ({**NGRAM, "prompt_lookup_min": 5}, r"prompt_lookup_min \(5\) must be <= prompt_lookup_max \(4\)"),
        ({**NGRAM, "draft_temperature": 1.0}, "unknown key"),
    ],
)
def test_bad_configs_are_one_line_errors(spec, message) -> None:
    with pytest.raises(ValueError, match=message) as err:
        SpeculativeConfig.parse(spec)
    assert "\n" not in str(err.value)


# -- prompt lookup ------------------------------------------------------------------
def test_a_sequence_whose_drafts_fail_stops_drafting_and_probes_ever_less_often() -> None:
    gate = AcceptanceGate(min_acceptance=0.5, probe_every=4)
    bad, good = (SimpleNamespace(draft_acceptance=None, probe_every=0) for _ in range(2))
    drafted: dict[str, list[int]] = {"bad": [], "good": []}
    for _ in range(64):
        gate.begin_step()
        for name, seq, kept in (("bad", bad, 0), ("good", good, 4)):
            if gate.allows(seq):
                drafted[name].append(gate.step)
                gate.record(seq, 4, kept)
    assert drafted["good"] == list(range(1, 65))
    # five rejected verdicts take it under 0.5 (one or two misses in a run of copied
    # text do not); then probes 3, 8, 16, 32 steps apart, on steps every other idle
    # sequence probes too (their intervals are powers of two)
    assert drafted["bad"] == [1, 2, 3, 4, 5, 8, 16, 32, 64]
    assert bad.probe_every == 64  # MAX_PROBE_EVERY
    for _ in range(3):  # its text turned repetitive: a kept probe brings the next one close
        gate.record(bad, 4, 4)
    assert gate.paying(bad) and bad.probe_every == 0
    always = AcceptanceGate(min_acceptance=0.0)  # vLLM's behaviour
    assert always.allows(SimpleNamespace(draft_acceptance=0.0, probe_every=0))


def test_a_new_sequence_starts_from_the_engines_recent_acceptance() -> None:
    gate = AcceptanceGate(min_acceptance=0.5, probe_every=8)
    first = SimpleNamespace(draft_acceptance=None, probe_every=0)
    assert gate.paying(first)  # nothing measured yet: drafts
    for _ in range(40):  # the engine's drafts keep missing
        gate.record(SimpleNamespace(draft_acceptance=None, probe_every=0), 4, 0)
    new = SimpleNamespace(draft_acceptance=None, probe_every=0)
    gate.begin_step()
    assert gate.acceptance(new) < 0.5 and not gate.allows(new)  # waits for the probe step
    gate.step = 7
    gate.begin_step()
    assert not gate.allows(new)  # not the 8-step probes of a sequence that paid before
    gate.step = 63
    gate.begin_step()
    assert gate.allows(new)
    for _ in range(4):  # its own text repeats: its own verdicts take over
        gate.record(new, 4, 4)
    assert gate.paying(new)


def test_at_most_one_in_eight_sequences_probes_a_step_and_each_gets_its_turn() -> None:
    gate = AcceptanceGate(min_acceptance=0.5)
    probing = list(range(5))
    assert gate.sample_probes(probing, running=8) == [0]  # one of 8 running
    assert gate.sample_probes(probing, running=40) == probing  # five of 40
    seen = set()
    for _ in range(5):
        gate.begin_step()
        seen.update(gate.sample_probes(probing, running=16))  # two a step
    assert seen == set(probing)


def test_expected_tokens_and_row_buckets() -> None:
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert [bucket(r) for r in (1, 16, 17, 20, 21, 33, 160, 161)] == [1, 16, 20, 20, 24, 40, 160, 192]


def test_step_cost_drafts_where_rows_are_cheap_and_not_where_they_cost_their_share() -> None:
    offers = [(0.9, 4), (0.6, 4), (0.3, 4)]  # best first
    cost = StepCost()
    assert cost.choose(1, offers, step=1) == 3  # nothing timed: drafts
    cost.record(1, False, 0.010)
    assert cost.choose(1, offers, step=2) == 1  # 5 rows never timed: tried
    for rows in (5, 9, 13):  # weight-bound: rows nearly free
        cost.record(rows, True, 0.011 + rows * 1e-4)
    assert cost.choose(1, offers, step=3) == 3
    busy = StepCost()  # a large batch: each row costs about its share
    for rows in (16, 20, 24, 28):
        busy.record(rows, rows > 16, 0.01 + rows * 4e-4)
    # 4 rows more: at 0.9, ~4.1 tokens (worth it); at 0.6, 2.3 and at 0.3, 1.4 (not)
    assert busy.choose(16, offers, step=3) == 1
    assert busy.choose(16, [(0.3, 4)], step=3) == 0
    assert busy.choose(16, [(0.3, 4)], step=EXPLORE_EVERY) == 1  # measured again now and then
    # ... one sequence more than the estimates say, not all of them (a cold
    # draft model's prefill of every history made that one step cost seven)
    assert busy.choose(16, [(0.3, 4)] * 3, step=EXPLORE_EVERY) == 1
    assert busy.choose(16, [(0.9, 4), (0.3, 4), (0.3, 4)], step=EXPLORE_EVERY) == 2


def test_step_cost_times_a_plain_step_while_drafting() -> None:
    """A stream that drafts every step never runs a plain step by itself:
    half-way between the explorations upwards one sequence fewer drafts,
    which times the plain step (never timed, or timed slow once) again."""
    offer = [(1.0, 4)]
    half = EXPLORE_EVERY // 2
    cost = StepCost()
    cost.record(5, True, 0.005)  # drafting: 5 tokens in 5 ms; no plain step timed yet
    assert [cost.choose(1, offer, step) for step in (1, 2, half - 1)] == [1, 1, 1]
    assert cost.choose(1, offer, step=half) == 0  # a plain step: that times it
    cost.record(1, False, 0.0006)
    assert cost.choose(1, offer, step=half + 1) == 0  # 1 token in 0.6 ms beats 5 in 5 ms
    stale = StepCost()
    stale.record(1, False, 0.010)  # timed cold: ten times what a plain step costs
    stale.record(5, True, 0.005)
    assert stale.choose(1, offer, step=1) == 1
    assert stale.choose(1, offer, step=half) == 0
    for _ in range(30):
        stale.record(1, False, 0.0006)  # what it costs now
    assert stale.choose(1, offer, step=half + 1) == 0


def test_one_stretched_step_does_not_stop_drafting() -> None:
    """A row count's estimate is the median of its last few times: one step
    a pause stretched (16x, as a collection or the event loop can) leaves the
    choice as it was; a cost that has really changed takes over in three."""
    offer = [(0.85, 4)]
    cost = StepCost()
    for _ in range(3):
        cost.record(1, False, 0.0008)
        cost.record(5, True, 0.001)
    cost.record(5, True, 0.016)
    assert cost.choose(1, offer, step=1) == 1
    for _ in range(2):
        cost.record(5, True, 0.016)
    assert cost.choose(1, offer, step=2) == 0


def test_ngram_drafts_what_followed_the_latest_repeat_of_the_suffix() -> None:
    proposer = NgramProposer(k=3, min_n=2, max_n=3)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3]
    assert proposer.propose(tokens, limit=3) == [7, 8, 6]  # the latest "1 2 3" with 3 tokens after it
    assert proposer.propose(tokens, limit=2) == [7, 8]
    assert proposer.propose([5, 6, 7, 8], limit=3) == []  # nothing repeats
    # only a repeat too close to the end: the one followed by the most tokens
    assert proposer.propose([4, 5, 1, 2, 1, 2], limit=3) == [1, 2]


def _lookup(tokens: list[int], k: int, min_n: int, max_n: int, limit: int) -> list[int]:
    """Prompt lookup by its definition, one n-gram length and one place at a time."""
    limit = min(limit, k)
    if limit < 1 or len(tokens) <= min_n:
        return []
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        starts = [s + n for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[-n:]]
        if starts:
            whole = [s for s in starts if len(tokens) - s >= limit]
            start = whole[-1] if whole else starts[0]
            return tokens[start : start + limit]
    return []


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 4), (2, 3), (3, 5)])
def test_ngram_matches_lookup_by_its_definition(min_n, max_n) -> None:
    """Random short histories over a few token ids (many repeats, of every length)."""
    gen = torch.Generator().manual_seed(min_n * 10 + max_n)
    proposer = NgramProposer(k=4, min_n=min_n, max_n=max_n)
    for _ in range(400):
        length = int(torch.randint(1, 40, (1,), generator=gen))
        tokens = torch.randint(0, 4, (length,), generator=gen).tolist()
        limit = int(torch.randint(0, 6, (1,), generator=gen))
        assert proposer.propose(tokens, limit) == _lookup(tokens, 4, min_n, max_n, limit), (tokens, limit)


# -- verification ---------------------------------------------------------------------
def _row(params: SamplingParams, history: list[int], seed: int = 0) -> SamplingRow:
    return SamplingRow(params, torch.Generator().manual_seed(seed), history, 1)


def test_greedy_keeps_drafts_while_each_is_the_argmax() -> None:
    logits = torch.full((4, 10), -5.0)
    for i, best in enumerate([3, 4, 7, 2]):
        logits[i, best] = 5.0
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    out = verify(logits, [3, 4, 5], _row(greedy, [1, 2]))
    assert (out.tokens, out.num_accepted) == ([3, 4, 7], 2)  # 5 rejected: the argmax 7 replaces it
    out = verify(logits, [3, 4, 7], _row(greedy, [1, 2]))
    assert (out.tokens, out.num_accepted) == ([3, 4, 7, 2], 3)  # all kept, then the bonus token


def test_a_steps_rows_checked_at_once_give_each_sequence_its_own_verdict() -> None:
    """Two sequences' rows in one tensor, taken in one pass (``StepChecks``):
    the same verdicts as one at a time, and a NaN fails only its sequence."""
    torch.manual_seed(0)
    rows = torch.randn(7, 128)  # a multiple of 64: row_max's blocked path on a CPU
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    first, second = rows[:3], rows[3:]
    drafts = [[int(first[0].argmax()), 5], [int(second[0].argmax()), int(second[1].argmax()), 9]]
    checks = StepChecks.of(rows)
    for logits, draft, at in ((first, drafts[0], 0), (second, drafts[1], 3)):
        alone, batched = verify(logits, draft, _row(greedy, [1])), verify(logits, draft, _row(greedy, [1]), checks, at)
        assert (batched.tokens, batched.num_accepted, batched.error) == (alone.tokens, alone.num_accepted, None)
    rows[5, 2] = float("nan")
    checks = StepChecks.of(rows)
    assert verify(rows[:3], drafts[0], _row(greedy, [1]), checks, 0).error is None
    assert "non-finite" in (verify(rows[3:], drafts[1], _row(greedy, [1]), checks, 3).error or "")
    rows[5, 2], rows[1, 7] = 0.0, float("inf")  # +inf: broken too (-inf is a masked token)
    checks = StepChecks.of(rows)
    assert "non-finite" in (verify(rows[:3], drafts[0], _row(greedy, [1]), checks, 0).error or "")
    assert verify(rows[3:], drafts[1], _row(greedy, [1]), checks, 3).error is None


def test_greedy_sees_the_drafts_before_it_in_its_history() -> None:
    """A repetition penalty over the history: the second row penalises the
    first draft, as the non-speculative second step would."""
    logits = torch.zeros(2, 6)
    logits[:, 3] = 2.0
    logits[:, 4] = 1.5
    params = SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=2.0)
    out = verify(logits, [3], _row(params, [0]))
    assert out.tokens == [3, 4]  # 3 penalised once it is in the history: 1.0 < 1.5


def test_rejection_sampling_follows_the_models_distribution() -> None:
    """Drafts proposed with certainty, kept with p(draft), else the rest of p:
    the first token's frequency over many seeds matches p, whether the
    draft is likely or not, and so does the second's given the first."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10)
    p = sampling_distribution(logits, [_row(params, [0])] * 3)
    trials = 4000

    def run(drafts: list[int], seed: int) -> list[int]:
        return _reject(p[: len(drafts) + 1], drafts, torch.Generator().manual_seed(seed))[0]

    for draft in ([int(p[0].argmax())], [int(p[0].argmin())]):
        first = torch.zeros(6)
        for seed in range(trials):
            first[run(draft, seed)[0]] += 1
        assert torch.allclose(first / trials, p[0], atol=0.03), (first / trials, p[0])
    drafts = [int(p[0].argmax()), int(p[1].argmax())]
    second, kept = torch.zeros(6), 0
    for seed in range(trials):
        tokens = run(drafts, seed)
        if tokens[0] == drafts[0]:
            kept += 1
            second[tokens[1]] += 1
    assert torch.allclose(second / kept, p[1], atol=0.04)
    # verify() itself samples from the same distribution as the sampler would
    out = verify(logits[:2], [int(p[0].argmax())], _row(params, [0], 7))
    assert 1 <= len(out.tokens) <= 2 and out.num_accepted in (0, 1)


# -- the engine -----------------------------------------------------------------------
def _repeating(prompt_of, n: int, seed: int) -> list[int]:
    """A prompt whose middle repeats: prompt lookup has something to copy."""
    block = prompt_of(n, seed)
    return block + block + block[: n // 2]


def _requests(prompt_of, greedy) -> list:
    return [
        (f"g{i}", _repeating(prompt_of, 6 + i, i), greedy(24, logprobs=1)) for i in range(4)
    ] + [
        ("long", _repeating(prompt_of, 30, 9), greedy(20)),  # chunked: the budget is 32
        ("stop", _repeating(prompt_of, 8, 3), greedy(30, stop_token_ids=[7])),
    ]


@pytest.mark.parametrize(
    "pool", [dict(num_gpu_blocks=30), dict(kv_cache_backend="contiguous", max_batch_size=4)]
)
def test_greedy_output_is_identical_with_and_without_speculation(
    make_cycling, run_engine, prompt_of, greedy, pool
) -> None:
    config = dict(max_num_batched_tokens=32, **pool)
    requests = _requests(prompt_of, greedy)
    ref = run_engine(make_cycling(**config), requests)
    engine = make_cycling(speculative_config=NGRAM, **config)
    run = run_engine(engine, requests)
    for key, choice in ref.choices.items():
        got = run.choices[key]
        assert (got.token_ids, got.text, got.finish_reason) == (
            choice.token_ids, choice.text, choice.finish_reason
        ), key
        assert got.logprobs == pytest.approx(choice.logprobs, abs=1e-4), key
    m = engine.metrics()
    assert m["spec_decode_num_draft_tokens_total"] > 0 and m["spec_decode_num_accepted_tokens_total"] > 0
    assert run.steps < ref.steps  # drafts kept: fewer passes for the same tokens
    if "num_gpu_blocks" in pool:
        assert m["num_preemptions_total"] > 0
    assert engine.audit() == [] and m["kv_cache_usage_perc"] == 0.0


def test_a_seeded_request_gives_the_same_text_whatever_its_neighbours(
    make_cycling, run_engine, prompt_of, greedy
) -> None:
    seeded = SamplingParams(max_tokens=30, temperature=0.8, seed=11, ignore_eos=True)
    prompt = _repeating(prompt_of, 8, 5)
    alone = run_engine(make_cycling(speculative_config=NGRAM), [("s", prompt, seeded)])
    crowd = run_engine(
        make_cycling(speculative_config=NGRAM),
        [("s", prompt, seeded)] + [(f"n{i}", _repeating(prompt_of, 7, i), greedy(30)) for i in range(3)],
    )
    assert crowd.tokens("s") == alone.tokens("s")


def test_rejected_drafts_never_reach_the_prefix_cache(make_cycling, run_engine, prompt_of, greedy) -> None:
    """Every block the cache registered after a speculative run holds the
    tokens the sequence really has: a new request of prompt + output hits
    exactly its full blocks, and its continuation is the plain engine's."""
    prompt = _repeating(prompt_of, 9, 2)
    engine = make_cycling(speculative_config=NGRAM, num_gpu_blocks=64)
    first = run_engine(engine, [("a", prompt, greedy(25))])
    assert engine.metrics()["spec_decode_num_accepted_tokens_total"] > 0
    history = prompt + first.tokens("a")
    again = run_engine(engine, [("b", history, greedy(6))])
    plain = run_engine(make_cycling(), [("b", history, greedy(6))])
    assert again.tokens("b") == plain.tokens("b")
    hits = engine.metrics()["prefix_cache_hits_total"]
    assert hits == (len(history) - 1) // 4 * 4  # every full block but the prompt's last token's
    assert engine.audit() == []


def test_disable_by_batch_size_stops_speculation_under_load(make_cycling, run_engine, prompt_of, greedy) -> None:
    engine = make_cycling(speculative_config={**NGRAM, "disable_by_batch_size": 3})
    run_engine(engine, [(f"r{i}", _repeating(prompt_of, 6, i), greedy(12)) for i in range(6)])
    busy = engine.metrics()["spec_decode_num_drafts_total"]
    run_engine(engine, [("alone", _repeating(prompt_of, 6, 9), greedy(12))])
    assert engine.metrics()["spec_decode_num_drafts_total"] > busy  # alone, it speculates


@pytest.mark.parametrize("step_s, row_s, drafts", [(0.01, 0.0, True), (0.0, 1e-3, False)])
def test_sequences_draft_only_where_measured_steps_say_it_pays(
    make_cycling, run_engine, prompt_of, greedy, monkeypatch, step_s, row_s, drafts
) -> None:
    """Steps timed as weight-bound (extra rows free) draft; steps where each
    row costs its share and verifying costs a little more (drafts bring at
    most a token a row) do not. The same greedy tokens either way."""
    requests = [(f"r{i}", _repeating(prompt_of, 6, i), greedy(12)) for i in range(6)]
    engine = make_cycling(speculative_config=NGRAM)
    cost = engine._step_cost
    for rows in range(1, 64):
        for drafted in (False, True):
            cost.record(rows, drafted, step_s + rows * row_s + (2e-3 if drafted else 0.0))
    monkeypatch.setattr(cost, "record", lambda *args: None)  # these times, whatever the machine's
    run = run_engine(engine, requests)
    assert (engine.metrics()["spec_decode_num_drafts_total"] > 0) == drafts
    plain = run_engine(make_cycling(), requests)
    assert {k: c.token_ids for k, c in run.choices.items()} == {k: c.token_ids for k, c in plain.choices.items()}


@pytest.mark.backend
def test_greedy_speculation_matches_on_the_backend(make_cycling, run_engine, prompt_of, greedy, attention_backend) -> None:
    requests = [(f"g{i}", _repeating(prompt_of, 6 + i, i), greedy(12)) for i in range(2)]
    ref = run_engine(make_cycling(attention_backend=attention_backend), requests)
    run = run_engine(make_cycling(attention_backend=attention_backend, speculative_config=NGRAM), requests)
    assert {k: c.token_ids for k, c in run.choices.items()} == {k: c.token_ids for k, c in ref.choices.items()}


def test_explorations_back_off_while_they_change_nothing() -> None:
    """A draft model that never pays at one stream is explored upwards every
    64 steps, then every 128, 256, ... up to MAX_EXPLORE_EVERY while each
    exploration leaves the choice as it was (each one can cost a catch-up
    over a whole prompt); a different choice brings them back to 64."""
    cost = StepCost()
    cost.record(1, False, 0.0005)
    cost.record(5, True, 0.004)  # 5 tokens in 4 ms: worse than 1 in 0.5
    offer = [(0.9, 4)]
    explored = [step for step in range(1, 4000) if cost.choose(1, offer, step) == 1]
    assert explored == [64, 128, 256, 512, 1024, 2048, 3072]
    assert cost.explore_every == MAX_EXPLORE_EVERY
    for _ in range(20):
        cost.record(5, True, 0.001)  # drafting pays now (5 tokens in 1 ms)
    assert cost.choose(1, offer, 4096) == 1 and cost.explore_every == EXPLORE_EVERY
