"""Sampler filters against distributions computed by hand on small logits,
plus batch behaviour: per-row seeds, greedy, logprobs and NaN isolation."""

from __future__ import annotations

import math

import pytest
import torch

from paged_server.engine.sample.sampler import (
    SamplingRow,
    apply_penalties,
    row_max,
    sample,
    sampling_distribution,
)
from paged_server.sampling_params import SamplingParams

# probabilities 0.5, 0.25, 0.15, 0.07, 0.03 (in shuffled order)
PROBS = torch.tensor([0.07, 0.5, 0.03, 0.25, 0.15])
LOGITS = PROBS.log().unsqueeze(0)


def row(generator: torch.Generator | None = None, prompt=(), output=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), generator, [*prompt, *output], len(prompt))


def dist(**params) -> list[float]:
    return sampling_distribution(LOGITS, [row(**params)])[0].tolist()


def renorm(weights: list[float]) -> list[float]:
    return [w / sum(weights) for w in weights]


def test_top_k_keeps_the_k_most_likely() -> None:
    assert dist(top_k=2) == pytest.approx(renorm([0, 0.5, 0, 0.25, 0]))
    assert dist(top_k=0) == pytest.approx(PROBS.tolist())  # off
    assert dist(top_k=99) == pytest.approx(PROBS.tolist())


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # sorted: 0.5, 0.25 (0.75), 0.15 (0.90), 0.07 (0.97), 0.03
    assert dist(top_p=0.7) == pytest.approx(renorm([0, 0.5, 0, 0.25, 0]))
    assert dist(top_p=0.8) == pytest.approx(renorm([0, 0.5, 0, 0.25, 0.15]))
    assert dist(top_p=0.1) == pytest.approx([0, 1, 0, 0, 0])  # the top token always stays


def test_min_p_is_relative_to_the_top_probability() -> None:
    # threshold 0.2 * 0.5 = 0.1: keeps 0.5, 0.25, 0.15
    assert dist(min_p=0.2) == pytest.approx(renorm([0, 0.5, 0, 0.25, 0.15]))


def test_filters_combine_after_temperature() -> None:
    # T=0.5 squares probabilities: 0.25, 0.0625, 0.0225, ...; top_k=3 then top_p=0.9
    # of the renormalized (0.25, 0.0625, 0.0225)/0.335 = 0.746, 0.187, 0.067: keep 2.
    got = dist(temperature=0.5, top_k=3, top_p=0.9)
    assert got == pytest.approx(renorm([0, 0.25, 0, 0.0625, 0]))


def test_filters_take_one_parameter_per_row() -> None:
    out = sampling_distribution(LOGITS.repeat(2, 1), [row(top_k=1), row(top_k=3)])
    assert out[0].tolist() == pytest.approx([0, 1, 0, 0, 0])
    assert out[1].tolist() == pytest.approx(renorm([0, 0.5, 0, 0.25, 0.15]))


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    # repetition 2 on tokens seen in prompt (0) or output (1, 1): 2 -> 1, -1 -> -2
    out = apply_penalties(logits, [row(prompt=[0], output=[1, 1], repetition_penalty=2.0)])
    assert out.tolist() == [[1.0, -2.0, 0.5, 1.0]]
    # frequency 0.5 per occurrence, presence 0.25 once, output tokens only
    out = apply_penalties(
        logits, [row(prompt=[3], output=[1, 1, 2], frequency_penalty=0.5, presence_penalty=0.25)]
    )
    assert out.tolist() == [[2.0, -1.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25, 1.0]]
    assert apply_penalties(logits, [row(output=[0])]) is logits  # nothing to do


def test_sampling_follows_the_filtered_distribution() -> None:
    """top_k=3 at temperature 1: 0.5/0.9, 0.25/0.9, 0.15/0.9 (hand-computed)."""
    gen = torch.Generator().manual_seed(0)
    rows = [row(gen, top_k=3)] * 4000
    counts = torch.bincount(
        torch.tensor(sample(LOGITS.repeat(4000, 1), rows).token_ids), minlength=5
    )
    freq = counts.float() / 4000
    assert counts[0] == 0 and counts[2] == 0
    for token, p in ((1, 0.5 / 0.9), (3, 0.25 / 0.9), (4, 0.15 / 0.9)):
        assert abs(freq[token].item() - p) < 0.03


def test_temperature_sharpens_as_hand_computed() -> None:
    """T=0.5 squares probabilities: 0.25/(0.25+0.0625) = 0.8 for the top of two."""
    logits = torch.tensor([[math.log(0.5), math.log(0.25)]])
    gen = torch.Generator().manual_seed(1)
    toks = sample(logits.repeat(4000, 1), [row(gen, temperature=0.5)] * 4000).token_ids
    assert abs(toks.count(0) / 4000 - 0.8) < 0.03


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-6])
def test_tiny_temperature_is_greedy(temperature: float) -> None:
    """logits / 1e-40 overflow to inf; sampling from that returned the last
    vocabulary id. Below 1e-5 the row takes the argmax instead."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2)) * 5
    gen = torch.Generator().manual_seed(0)
    out = sample(logits, [row(gen, temperature=temperature)] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.errors == [None] * 4
    assert SamplingParams(temperature=temperature).greedy
    assert not SamplingParams(temperature=1e-5).greedy


def test_greedy_is_argmax_after_penalties() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert sample(logits, [row(temperature=0.0)]).token_ids == [0]
    out = sample(logits, [row(temperature=0.0, output=[0], frequency_penalty=1.0)])
    assert out.token_ids == [1]


def test_seeded_rows_do_not_depend_on_batch_neighbours() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))

    def draws(batch_with: int) -> list[int]:
        mine = torch.Generator().manual_seed(42)
        other = torch.Generator().manual_seed(7)
        out = []
        for _ in range(20):
            rows = [row(other, temperature=1.3)] * batch_with + [row(mine, top_p=0.9)]
            out.append(sample(logits.repeat(batch_with + 1, 1), rows).token_ids[-1])
        return out

    assert draws(0) == draws(3)
    assert len(set(draws(0))) > 3  # really random, not constant


@pytest.mark.parametrize("neighbour", [{"top_p": 0.5}, {"top_k": 3}, {"min_p": 0.2}])
def test_seeded_row_ignores_its_neighbours_filters(neighbour: dict[str, float]) -> None:
    """A filtered neighbour must not change an unfiltered seeded row's token
    (it did when any filter sorted every row before the draw), nor the reverse."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(5))

    def token(params: dict[str, float], seed: int, with_neighbour: bool) -> int:
        mine = row(torch.Generator().manual_seed(seed), **params)
        if not with_neighbour:
            return sample(logits, [mine]).token_ids[0]
        other = row(torch.Generator().manual_seed(1000 + seed), **neighbour)
        return sample(logits.repeat(3, 1), [other, mine, other]).token_ids[1]

    for params in ({}, {"temperature": 0.7}, {"top_k": 10}):
        alone = [token(params, seed, False) for seed in range(30)]
        assert [token(params, seed, True) for seed in range(30)] == alone, params
        assert len(set(alone)) > 3  # really random, not constant


def test_a_draw_at_the_top_of_the_cdf_takes_a_token_with_mass(monkeypatch) -> None:
    """A uniform that rounds onto the CDF total used to clamp to the last
    position, a token the filter had removed."""
    import paged_server.engine.sample.sampler as sampler

    monkeypatch.setattr(sampler, "uniform", lambda generator: 1.0)
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    assert sample(logits, [row(top_k=2)]).token_ids == [1]
    assert sample(logits[:, [2, 0, 1]], [row(top_k=2)]).token_ids == [2]


def test_logprobs_are_the_models_log_softmax() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    out = sample(logits, [row(temperature=0.0, logprobs=0, repetition_penalty=1.5, output=[2])])
    expected = torch.log_softmax(logits, -1)[0, out.token_ids[0]].item()
    assert out.logprobs[0] is not None
    assert out.logprobs[0].logprob == pytest.approx(expected)
    assert sample(logits, [row(temperature=0.0)]).logprobs == [None]


def test_nan_row_fails_alone() -> None:
    logits = torch.tensor([[0.0, 1.0], [float("nan"), 1.0], [2.0, 0.0]])
    out = sample(logits, [row(temperature=0.0)] * 3)
    assert out.token_ids[0] == 1 and out.token_ids[2] == 0
    assert out.errors[0] is None and out.errors[2] is None
    assert out.token_ids[1] == -1 and "non-finite" in (out.errors[1] or "")


def test_top_logprobs_list_the_n_most_likely_with_the_chosen_token() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [0.0, 0.0, 5.0, 1.0]])
    out = sample(logits, [row(temperature=0.0, logprobs=2), row(temperature=0.0, logprobs=0)])
    expected = torch.log_softmax(logits, -1)
    first, second = out.logprobs
    assert first is not None and second is not None
    assert [t for t, _ in first.top] == [1, 2]
    assert [lp for _, lp in first.top] == pytest.approx(expected[0, [1, 2]].tolist())
    assert first.rank == 1 and first.as_dict().keys() == {1, 2}
    assert second.top == [] and second.token_id == 2


def test_logit_bias_moves_the_argmax_but_not_the_logprobs() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0]])
    out = sample(logits, [row(temperature=0.0, logprobs=1, logit_bias={0: 100.0})])
    assert out.token_ids == [0]
    assert out.logprobs[0] is not None
    assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 0].item())
    assert out.logprobs[0].rank == 3
    assert sample(logits, [row(temperature=0.0, logit_bias={1: -100.0})]).token_ids == [2]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]])  # 0 = EOS, 1 = a stop token

    def pick(generated: int) -> int:
        params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])
        r = SamplingRow(params, None, [3] * (4 + generated), 4, eos_token_ids=(0,))
        return sample(logits, [r]).token_ids[0]

    assert pick(0) == 2 and pick(1) == 2
    assert pick(2) == 0  # reached: EOS allowed again


def test_top_k_minus_one_means_off() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert dist(top_k=-1) == pytest.approx(PROBS.tolist())


@pytest.mark.parametrize("vocab", [64, 4096, 32000, 1000])
def test_row_max_is_torch_max_first_occurrence_included(vocab: int) -> None:
    """The CPU's blockwise max (and the plain path for a vocabulary that is
    not a multiple of its block) gives torch.max's values and first indices,
    with ties, NaN and all -inf rows."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g)
    logits[1, :] = 0.5  # every entry tied: index 0
    logits[2, vocab // 3] = logits[2, vocab - 1] = 9.0  # tie across blocks: the first
    logits[3, vocab // 2] = float("nan")
    logits[4, :] = float("-inf")
    logits[5, vocab - 1] = float("inf")
    values, indices = row_max(logits)
    want = logits.max(dim=-1)
    assert torch.equal(indices, want.indices)
    assert torch.equal(values.nan_to_num(), want.values.nan_to_num())
    assert indices.tolist()[:4] == [want.indices[0].item(), 0, vocab // 3, vocab // 2]


# Doubles vLLM accepts that float32 cannot hold: 5e-324 and 1e-40 become 0
# (or a subnormal), 1e300 becomes inf.
TINY = [5e-324, 1e-40]
HUGE = [1e300, 1e39]


def _masked(vocab: int, allowed: list[int], seed: int = 5) -> torch.Tensor:
    """Logits of one row with every token but ``allowed`` at -inf (a grammar's mask)."""
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    keep = torch.zeros(1, vocab, dtype=torch.bool)
    keep[0, allowed] = True
    return logits.masked_fill(~keep, float("-inf"))


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("penalty", [5e-324, *HUGE])
def test_extreme_repetition_penalty_never_unmasks_a_token(penalty: float, greedy: bool) -> None:
    """The fuzzed request (issue 53): repetition_penalty 5e-324 and top_p
    5e-324 under a grammar allowing only EOS gave token 4095. float32 made
    the penalty 0: masked -inf * 0 = NaN, and the NaN's index was drawn."""
    eos, vocab = 2, 4096
    logits = _masked(vocab, [eos])
    prompt = list(range(0, vocab, 7)) + [eos, vocab - 1]  # seen tokens, masked and allowed
    gen = torch.Generator().manual_seed(0)
    params = {"temperature": 0.0} if greedy else {"top_p": 5e-324}
    out = sample(logits, [row(gen, prompt=prompt, repetition_penalty=penalty, **params)])
    assert (out.token_ids, out.errors) == ([eos], [None])


@pytest.mark.parametrize("penalty", TINY)
def test_tiny_repetition_penalty_acts_as_its_limit(penalty: float) -> None:
    """As the penalty goes to 0 a seen token with a positive logit outweighs
    every other (x / penalty grows without bound); with float32's 0 its logit
    was inf and the distribution NaN."""
    logits = torch.tensor([[1.0, 3.0, 0.5, -1.0]])
    got = sampling_distribution(logits, [row(prompt=[0, 3], repetition_penalty=penalty)])[0]
    assert got.tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("penalty", HUGE)
def test_huge_repetition_penalty_acts_as_its_limit(penalty: float) -> None:
    """As the penalty grows a seen token with a positive logit tends to 0 and
    one with a negative logit to -inf; float32's inf made a 0 logit NaN."""
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0]])
    got = sampling_distribution(logits, [row(prompt=[0, 1, 3], repetition_penalty=penalty)])[0]
    assert got.tolist() == pytest.approx(renorm([1.0, 1.0, math.e, 0.0]))


@pytest.mark.parametrize("temperature", HUGE)
def test_huge_temperature_is_uniform_over_the_allowed_tokens(temperature: float) -> None:
    """The limit of a growing temperature; float32's inf made -inf / inf NaN."""
    logits = _masked(6, [1, 4])
    assert dist_of(logits, temperature=temperature) == pytest.approx([0, 0.5, 0, 0, 0.5, 0])
    gen = torch.Generator().manual_seed(0)
    out = sample(logits.repeat(64, 1), [row(gen, temperature=temperature)] * 64)
    assert set(out.token_ids) == {1, 4} and out.errors == [None] * 64


def dist_of(logits: torch.Tensor, **params) -> list[float]:
    return sampling_distribution(logits, [row(**params)])[0].tolist()


@pytest.mark.parametrize("greedy", [True, False])
def test_a_row_the_edits_make_nan_gets_an_error_not_a_masked_token(monkeypatch, greedy: bool) -> None:
    """Whatever makes a row NaN after the mask, its token is never one the
    mask forbade (NaN counts as the largest, so its index was taken); the
    neighbour is unharmed."""
    from paged_server.engine.sample import sampler

    def nan_where_masked(logits: torch.Tensor, rows) -> torch.Tensor:
        out = logits.clone()
        out[0] = torch.where(torch.isneginf(out[0]), float("nan"), out[0])
        return out

    monkeypatch.setattr(sampler, "apply_penalties", nan_where_masked)
    logits = torch.cat([_masked(8, [3]), _masked(8, [5])])
    temperature = 0.0 if greedy else 1.0
    out = sample(logits, [row(temperature=temperature, repetition_penalty=1.5, output=[3])] * 2)
    assert out.token_ids == [-1, 5]
    assert "NaN or inf" in (out.errors[0] or "") and out.errors[1] is None
