"""Which sequences draft this step: those whose drafts have been paying.

A verify step (a sequence's last token and ``k`` drafts) costs more than a
decode step, so a sequence whose drafts keep being rejected is slower
speculating than not (docs/benchmarks.md measures the cost). Each
sequence keeps a moving average of the share of its drafts kept; below
``min_acceptance`` (0.3 by default; above it the measured step cost,
``StepCost``, decides whether its drafts pay) it stops drafting and probes
again later, in case its text has turned repetitive: first
``probe_every`` steps on, then twice as far each time a probe fails (up
to ``MAX_PROBE_EVERY``). Probes fall on
steps numbered by the engine, so every idle sequence probes in the same
step and the other steps stay plain decode steps (staggered probes made
every step of a large batch a verify step). A sequence that has not
drafted yet starts from the engine's recent acceptance over all
sequences (and, below ``min_acceptance``, probes every ``MAX_PROBE_EVERY``
steps), so a stream of new requests on text the drafts miss does not pay
rejected verify steps each before its gate closes. vLLM drafts for every
sequence; ``"min_acceptance": 0`` in ``--speculative-config`` does the
same here.
"""

from __future__ import annotations

from typing import TypeVar

from paged_server.engine.request.sequence import Sequence

T = TypeVar("T")

# of the newest verdict in the moving average: about seven decide. Copied
# text is kept or missed in runs (a phrase the lookup gets wrong, then the
# copy goes on), and at 0.3 two misses closed the gate on a sequence about
# to copy again: prompt lookup on the copying pair ran 0.92x at 32 streams
# against 1.11x for 0.15 with the 0.3 floor below (docs/serving.md).
WEIGHT = 0.15
ENGINE_WEIGHT = 0.05  # the same over every sequence's verdicts
MAX_PROBE_EVERY = 64
PROBES_PER = 8  # running sequences per probe in one step (at least one probes)


class AcceptanceGate:
    """Per-sequence gate on drafting, from the acceptance of its own drafts."""

    def __init__(self, min_acceptance: float, probe_every: int = 8) -> None:
        self.min_acceptance, self.probe_every = min_acceptance, probe_every
        self.step = 0  # the engine's step count (``begin_step``)
        self.recent = 1.0  # acceptance over all sequences' recent verdicts

    def begin_step(self) -> None:
        self.step += 1

    def acceptance(self, seq: Sequence) -> float:
        """``seq``'s recent acceptance, or the engine's before it has any."""
        return self.recent if seq.draft_acceptance is None else seq.draft_acceptance

    def paying(self, seq: Sequence) -> bool:
        """Whether ``seq``'s recent drafts were kept often enough."""
        return self.acceptance(seq) >= self.min_acceptance

    def allows(self, seq: Sequence) -> bool:
        """Whether ``seq`` drafts this step: its drafts pay, or it probes (a
        sequence with no verdicts of its own in an engine whose drafts miss:
        as seldom as a sequence whose probes keep failing)."""
        if self.paying(seq):
            return True
        every = MAX_PROBE_EVERY if seq.draft_acceptance is None else max(self.probe_every, seq.probe_every)
        return self.step % every == 0

    def sample_probes(self, probing: list[T], running: int) -> list[T]:
        """At most one in ``PROBES_PER`` of the ``running`` sequences probes in
        a step (a different few each time): a probe of a draft model first
        catches the draft up on the sequence's whole context, so 32 new
        streams probing at once made one step cost ten."""
        most = max(1, running // PROBES_PER)
        if len(probing) <= most:
            return probing
        start = (self.step * most) % len(probing)
        return (probing[start:] + probing[:start])[:most]

    def record(self, seq: Sequence, drafted: int, kept: int) -> None:
        """One verdict: ``kept`` of ``drafted`` drafts accepted."""
        if not drafted:
            return
        was_paying, share, acceptance = self.paying(seq), kept / drafted, self.acceptance(seq)
        seq.draft_acceptance = acceptance + WEIGHT * (share - acceptance)
        self.recent += ENGINE_WEIGHT * (share - self.recent)
        if share >= self.min_acceptance:  # the next probe (if still needed) comes soon
            seq.probe_every = 0
        elif not was_paying:  # a failed probe: wait twice as long for the next
            seq.probe_every = min(2 * max(self.probe_every, seq.probe_every), MAX_PROBE_EVERY)
