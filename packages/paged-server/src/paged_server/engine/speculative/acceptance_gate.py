"""Which sequences draft this step: those whose drafts have been paying.

A verify step (a sequence's last token and ``k`` drafts) costs more than a
decode step, so a sequence whose drafts keep being rejected is slower
speculating than not (docs/benchmarks.md measures the cost). Each
sequence keeps a moving average of the share of its drafts kept; below
``min_acceptance`` it stops drafting, and tries again every
``probe_every`` steps in case its text has turned repetitive. vLLM drafts
for every sequence; ``"min_acceptance": 0`` in ``--speculative-config``
does the same here.
"""

from __future__ import annotations

from paged_server.engine.request.sequence import Sequence

WEIGHT = 0.3  # of the newest verdict in the moving average: a few steps decide


class AcceptanceGate:
    """Per-sequence gate on drafting, from the acceptance of its own drafts."""

    def __init__(self, min_acceptance: float, probe_every: int = 8) -> None:
        self.min_acceptance, self.probe_every = min_acceptance, probe_every

    def allows(self, seq: Sequence) -> bool:
        """Whether ``seq`` drafts this step (counts the steps it does not)."""
        if seq.draft_acceptance >= self.min_acceptance or seq.steps_without_draft >= self.probe_every:
            seq.steps_without_draft = 0
            return True
        seq.steps_without_draft += 1
        return False

    @staticmethod
    def record(seq: Sequence, drafted: int, kept: int) -> None:
        """One verdict: ``kept`` of ``drafted`` drafts accepted."""
        if drafted:
            seq.draft_acceptance += WEIGHT * (kept / drafted - seq.draft_acceptance)
