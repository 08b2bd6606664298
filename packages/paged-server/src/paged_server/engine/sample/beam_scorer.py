"""The beam scorer of one request: which beams continue, which finish.

Semantics are transformers' ``generate(num_beams=k, do_sample=False)``,
step for step, so results match it token for token:

- each step scores every (beam, token) continuation as the beam's running
  log-probability plus the token's log-probability (float32, as there) and
  keeps the best ``max(2, 1 + number of stop ids) * k`` candidates;
- a candidate whose token is a stop id (or that reaches ``max_tokens``)
  is a finished hypothesis if it ranks among the first ``k`` candidates; its
  score is its log-probability over ``generated_length ** length_penalty``
  (a factor that saturates at the float range, so no penalty overflows:
  scores then tie at -0.0 or -inf and earlier hypotheses win);
  the ``k`` best finished hypotheses are kept;
- the ``k`` best candidates that did not finish are next step's beams;
- the search ends when every candidate finished (``max_tokens``), when
  ``early_stopping=True`` and ``k`` hypotheses are finished, or when the
  best running beam can no longer beat the worst of ``k`` finished ones
  (judged at the current length, or at ``max_tokens`` for ``"never"`` with a
  positive length penalty).

Before the first step only beam 0 exists: the others start at -1e9, so all
first candidates come from it. A candidate at -inf (a token the request's
constraints forbid) or descended from those -1e9 starts (when fewer
continuations exist than beams) is never a hypothesis, and the search ends
when no running beam is left with a real score. With ``num_top_logprobs`` each position of a
hypothesis also keeps the ``N`` most likely tokens of its beam's row. The
scorer knows tensors and token ids only; the engine maps its answer onto
sequences and their blocks.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import Tensor

_NEG = -1.0e9  # transformers' "impossible" score
_IMPOSSIBLE = _NEG / 2  # at or below: not a sequence the request can produce

TopLogprobs = list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass(slots=True)
class _History:
    """A running beam's generated tokens, their logprobs and top alternatives."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[TopLogprobs] = field(default_factory=list)

    def extended(self, token_id: int, logprob: float, top: TopLogprobs) -> _History:
        return _History(self.token_ids + [token_id], self.logprobs + [logprob], self.top + [top])


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its generated tokens and their log-probabilities."""

    token_ids: list[int]
    logprobs: list[float]
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # per position, when asked


@dataclass(slots=True)
class BeamStep:
    """What one step decided: beam ``j`` continues beam ``parents[j]`` with
    ``token_ids[j]``; when ``done`` the search is over."""

    parents: list[int]
    token_ids: list[int]
    done: bool


@dataclass(slots=True)
class BeamScorer:
    """Running beams' scores and histories, and the finished hypotheses."""

    beam_width: int
    max_tokens: int
    length_penalty: float
    early_stopping: bool | str
    stop_token_ids: Collection[int]
    num_top_logprobs: int = 0
    running_scores: Tensor = field(init=False)
    histories: list[_History] = field(init=False)
    finished: list[Hypothesis] = field(default_factory=list)
    num_generated: int = 0
    improvement_possible: bool = True
    done: bool = False

    def __post_init__(self) -> None:
        k = self.beam_width
        self.running_scores = torch.full((k,), _NEG, dtype=torch.float32)
        self.running_scores[0] = 0.0
        self.histories = [_History() for _ in range(k)]

    @property
    def num_candidates(self) -> int:
        return max(2, 1 + len(self.stop_token_ids)) * self.beam_width

    def step(self, logprobs: Tensor) -> BeamStep:
        """Advance by one token. ``logprobs`` is ``[beam_width, vocab]`` float32
        log-softmax rows, one per running beam (before the first step every
        row is beam 0's)."""
        assert not self.done, "the beam search is already finished"
        k = self.beam_width
        vocab = logprobs.shape[-1]
        scores = (logprobs + self.running_scores[:, None]).reshape(-1)
        top_scores, top_index = torch.topk(scores, min(self.num_candidates, scores.numel()))
        parents = (top_index // vocab).tolist()
        tokens = (top_index % vocab).tolist()
        length = self.num_generated + 1
        at_max = length >= self.max_tokens
        hits = torch.tensor([at_max or t in self.stop_token_ids for t in tokens])

        tops = self._top_logprobs(logprobs)
        self._add_finished(top_scores, parents, tokens, hits, logprobs, tops, length)
        running = top_scores + hits.to(torch.float32) * _NEG
        next_index = torch.topk(running, k).indices.tolist()
        self.running_scores = running[next_index]
        new_parents = [parents[i] for i in next_index]
        new_tokens = [tokens[i] for i in next_index]
        self.histories = [
            self.histories[p].extended(t, float(logprobs[p, t]), tops[p])
            for p, t in zip(new_parents, new_tokens, strict=True)
        ]
        self.num_generated = length
        self._check_early_stop()
        self.done = (
            not self.improvement_possible
            or (self.early_stopping is True and len(self.finished) == k)
            or bool(hits.all())
            or not bool((self.running_scores > _IMPOSSIBLE).any())
        )
        return BeamStep(new_parents, new_tokens, self.done)

    def _top_logprobs(self, logprobs: Tensor) -> list[TopLogprobs]:
        """Each beam row's ``num_top_logprobs`` most likely tokens (empty lists
        when none are asked for)."""
        n = min(self.num_top_logprobs, logprobs.shape[-1])
        if n == 0:
            return [[] for _ in range(logprobs.shape[0])]
        values, ids = logprobs.topk(n, dim=-1)
        return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]

    def best(self, n: int) -> list[Hypothesis]:
        """The ``n`` best finished hypotheses, best first."""
        return self.finished[:n]

    def _add_finished(
        self,
        top_scores: Tensor,
        parents: list[int],
        tokens: list[int],
        hits: Tensor,
        logprobs: Tensor,
        tops: list[TopLogprobs],
        length: int,
    ) -> None:
        """Candidates among the first ``k`` that hit a stop become hypotheses,
        unless ``early_stopping=True`` already has ``k`` of them."""
        k = self.beam_width
        if self.early_stopping is True and len(self.finished) == k:
            return
        normalised = top_scores / length_factor(length, self.length_penalty)
        new = []
        for i in range(min(k, len(tokens))):
            if not hits[i] or not top_scores[i] > _IMPOSSIBLE:
                continue
            p, t = parents[i], tokens[i]
            done = self.histories[p].extended(t, float(logprobs[p, t]), tops[p])
            new.append(
                Hypothesis(
                    done.token_ids,
                    done.logprobs,
                    float(top_scores[i]),
                    float(normalised[i]),
                    done.top,
                )
            )
        if new:
            merged = self.finished + new  # stable: earlier hypotheses win ties
            merged.sort(key=lambda h: -h.score)
            self.finished = merged[:k]

    def _check_early_stop(self) -> None:
        """Whether the best running beam could still beat the worst of ``k``
        finished hypotheses (sticky once it cannot)."""
        if len(self.finished) < self.beam_width:
            return
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = self.num_generated
        best_running = float(
            self.running_scores[:1] / length_factor(best_length, self.length_penalty)
        )
        worst_finished = min(h.score for h in self.finished)
        self.improvement_possible = self.improvement_possible and best_running > worst_finished


def length_factor(length: int, length_penalty: float) -> float:
    """``length ** length_penalty``, saturated to the positive float range:
    a penalty of 1024 overflowed (``OverflowError``) and a very negative one
    underflows to 0, which would divide a zero score into NaN."""
    try:
        factor = float(length) ** length_penalty
    except OverflowError:
        return math.inf
    return max(factor, sys.float_info.min)
