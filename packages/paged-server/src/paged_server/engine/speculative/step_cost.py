"""Whether drafting pays this step, from the measured time of steps.

A verify step computes each drafting sequence's last token and its drafts:
more rows than a decode step. Where a step is weight-bound (one stream on a
CPU, a small batch on a GPU) the extra rows are nearly free; where it is
compute-bound (a large batch) they cost about their share, and drafts that
are rejected half the time lose throughput. So the engine times its steps
by the rows they computed (a prompt chunk's rows cost as a verify step's
do) and whether they drafted (a draft model's own steps are inside the
time), and before each step ``choose`` keeps the drafting sequences, most
promising first, while each one raises the expected tokens per second of
the step. A row count
never timed is tried (that times it), and every ``EXPLORE_EVERY`` steps
one sequence more than the estimates say drafts (and half-way between, one
fewer), so an estimate that has gone stale (a warm-up step, a busy
machine) is measured again, one row count at a time. While those
explorations leave the choice as it was, they come half as often each
time (up to every ``MAX_EXPLORE_EVERY`` steps): an exploration can cost
several steps (a draft model catching up on a request's whole context
before its first draft), and one every 64 steps that kept answering
"do not draft" cost a one-stream draft model 14% of its speed.
vLLM's ``disable_by_batch_size`` is the fixed-threshold form of this.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

# A row count's estimate is the median of its last SAMPLES step times: one
# step that a pause stretched (a collection, the event loop holding the
# GIL: 16 ms against a 1 ms verify step, once, over HTTP) moved a moving
# average four-fold, the choice it made then stopped drafting, so nothing
# timed that row count again, and one stream served with prompt lookup
# ran for hundreds of steps at half its speed.
SAMPLES = 5
EXPLORE_EVERY = 64
MAX_EXPLORE_EVERY = 1024


def expected_tokens(acceptance: float, drafts: int) -> float:
    """Tokens a verify step yields for a sequence with ``drafts`` drafts each
    kept with probability ``acceptance``: (1 - a^(k+1)) / (1 - a)."""
    if acceptance >= 1.0:
        return drafts + 1.0
    return (1.0 - acceptance ** (drafts + 1)) / (1.0 - acceptance)


def bucket(rows: int) -> int:
    """Row counts timed together: exact up to 16, then 4 to an octave."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


class StepCost:
    """Step seconds by (row bucket, drafted): the median of the last few."""

    def __init__(self) -> None:
        self._times: dict[tuple[int, bool], deque[float]] = {}
        self._seconds: dict[tuple[int, bool], float] = {}  # their medians
        self.explore_every = EXPLORE_EVERY  # a power of two: doubles while explorations change nothing
        self._explored: tuple[int, int] | None = None  # (offers, choice) at the last exploration upwards

    def record(self, rows: int, drafted: bool, seconds: float) -> None:
        key = (bucket(rows), drafted)
        times = self._times.setdefault(key, deque(maxlen=SAMPLES))
        times.append(seconds)
        self._seconds[key] = statistics.median(times)

    def estimate(self, rows: int, drafted: bool) -> float | None:
        return self._seconds.get((bucket(rows), drafted))

    def choose(self, plain_rows: int, offers: Sequence[tuple[float, int]], step: int) -> int:
        """How many of ``offers`` ((acceptance, drafts) of each sequence that
        may draft, best first) draft beside a step of ``plain_rows`` rows."""
        if not offers:
            return 0
        plain = self.estimate(plain_rows, False)
        every = self.explore_every
        down = step % every == every // 2
        if plain is None:  # nothing to compare with: draft, but not half-way (below), which times it
            return 0 if down else len(offers)
        best, best_rate = 0, plain_rows / plain
        tokens, rows = float(plain_rows), plain_rows
        for m, (acceptance, drafts) in enumerate(offers, start=1):
            tokens += expected_tokens(acceptance, drafts) - 1.0
            rows += drafts
            seconds = self.estimate(rows, True)
            if seconds is None:
                return m  # untimed: try it
            if tokens / seconds > best_rate:
                best, best_rate = m, tokens / seconds
        # Now and then one sequence more than the estimates say: the next
        # row count is timed again, so a choice made on a busy machine can
        # grow back (one step drafting for all was a cold draft model's
        # prefill of every history: 37 ms against a 5 ms step at 32 streams).
        if step % every == 0:
            self._back_off((len(offers), best))
            return min(best + 1, len(offers))
        # ... and half-way between, one fewer: the smaller step is timed
        # again too (while a stream drafts every step, nothing else times
        # its plain step). Such a step, timed right after a draft model's
        # passes, is slower than a steady one (docs/serving.md).
        return max(best - 1, 0) if down else best

    def _back_off(self, choice: tuple[int, int]) -> None:
        """At an exploration upwards: explore half as often if the choice
        (offers, sequences drafting) is the one the last exploration made,
        else as often as at first."""
        same = choice == self._explored
        self.explore_every = min(2 * self.explore_every, MAX_EXPLORE_EVERY) if same else EXPLORE_EVERY
        self._explored = choice
