"""FCFS scheduler with the split interface of the design documents:
``retire()`` -> (engine frees slots) -> ``admit(free_kv_tokens)`` ->
``decode_sequences()`` + ``schedule_prefill(token_budget)``.

The scheduler knows budgets and order, never tensors or cache types: the
engine passes it the free capacity (``None`` for a contiguous pool) and an
``allocate`` callback that claims a slot or says no.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from paged_server.sequence import Sequence, SequenceStatus

# Share of free KV capacity admission leaves for running sequences to grow.
RESERVE_FRACTION = 0.2


class Scheduler:
    """Waiting queue (FCFS, preempted sequences at the front) and running set
    (in admission order, so the newest is last and is preempted first)."""

    def __init__(
        self,
        max_batch_size: int,
        block_size: int = 16,
        enable_chunked_prefill: bool = True,
        reserve_fraction: float = RESERVE_FRACTION,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.block_size = block_size
        self.enable_chunked_prefill = enable_chunked_prefill
        self.reserve_fraction = reserve_fraction
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # -- queue -----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence behind everything already waiting."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that got its slot outside ``admit`` (a fork of choice 0)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def requeue_front(self, seq: Sequence) -> None:
        """Put ``seq`` first in the queue (preempted, or a fork that found no slot)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def remove_waiting(self, seq: Sequence) -> bool:
        """Drop a waiting sequence (abort); ``False`` if it was not waiting."""
        try:
            self.waiting.remove(seq)
        except ValueError:
            return False
        return True

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def num_running_places(self) -> int:
        """Places in the running set taken, counting choices waiting to fork."""
        return sum(s.batch_slots_needed for s in self.running)

    # -- split step ------------------------------------------------------------
    def retire(self) -> list[Sequence]:
        """Take finished sequences out of the running set; the caller frees
        their slots before calling ``admit`` so the space is reusable at once."""
        retired = [s for s in self.running if s.is_finished]
        if retired:
            self.running = [s for s in self.running if not s.is_finished]
        return retired

    def admit(
        self,
        free_kv_tokens: int | None = None,
        allocate: Callable[[Sequence], bool] | None = None,
    ) -> list[Sequence]:
        """Move waiting sequences to running, in order, while they fit.

        Limits: ``max_batch_size`` running places (a request with ``n``
        choices takes ``n``), and, when ``free_kv_tokens`` is given (paged
        pool), a token budget that keeps a reserve for running sequences to
        grow: the larger of ``reserve_fraction`` of the free tokens and one
        block per running sequence. When nothing runs, the head of the queue
        may use the reserve too, so a large prompt cannot wait forever.
        ``allocate(seq)`` claims the slot (and may still say no); admission
        stops at the first sequence that does not fit (strict FCFS).
        """
        admitted: list[Sequence] = []
        places = self.max_batch_size - self.num_running_places()
        budget: int | None = None
        if free_kv_tokens is not None:
            reserve = max(
                free_kv_tokens - int(free_kv_tokens * (1.0 - self.reserve_fraction)),
                self.block_size * len(self.running),
            )
            budget = free_kv_tokens - reserve
        while self.waiting:
            seq = self.waiting[0]
            if seq.is_finished:  # e.g. a fork that finished on its first token
                self.waiting.popleft()
                continue
            if seq.batch_slots_needed > places:
                break
            cost = len(seq.token_ids)
            if budget is not None and free_kv_tokens is not None:
                alone = not self.running and not admitted
                if cost > budget and not (alone and cost <= free_kv_tokens):
                    break
            if allocate is not None and not allocate(seq):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.prefill_len = len(seq.token_ids)
            places -= seq.batch_slots_needed
            if budget is not None:
                budget -= cost
            admitted.append(seq)
            self.running.append(seq)
        return admitted

    def decode_sequences(self) -> list[Sequence]:
        """Running sequences past their prefill: one new token each this step."""
        return [s for s in self.running if not s.is_finished and not s.is_prefilling]

    def schedule_prefill(self, token_budget: int) -> list[tuple[Sequence, int]]:
        """Prefill chunks ``(seq, num_tokens)`` for this step, oldest first.

        With chunked prefill, chunks fill ``token_budget`` exactly. Without
        it, prompts run whole; the first one runs even if it overshoots the
        budget (by at most the decode tokens), so it cannot starve.
        """
        chunks: list[tuple[Sequence, int]] = []
        for seq in self.running:
            if seq.is_finished or not seq.is_prefilling:
                continue
            remaining = seq.prefill_len - seq.num_computed
            if self.enable_chunked_prefill:
                n = min(remaining, token_budget)
                if n <= 0:
                    break
            else:
                if remaining > token_budget and chunks:
                    break
                n = remaining
            chunks.append((seq, n))
            token_budget -= n
        return chunks

    def preempt_newest(self) -> Sequence | None:
        """Take the most recently admitted unfinished sequence out of the
        running set and put it at the front of the queue for recompute (its
        tokens so far become its next prefill). The caller frees ``seq.slot``
        and clears it. ``None`` when nothing can be preempted."""
        for i in range(len(self.running) - 1, -1, -1):
            seq = self.running[i]
            if not seq.is_finished:
                del self.running[i]
                seq.num_computed = 0
                seq.prefill_len = 0
                self.requeue_front(seq)
                return seq
        return None
