"""The scheduler: one token budget per step, shared by decodes and prefill chunks.

Every running sequence wants ``num_tokens - num_computed_tokens`` tokens
computed: 1 for a decode, a chunk of its prompt while prefilling, its whole
history after a preemption. Each step the scheduler walks the running set
oldest first and gives each sequence what the ``max_num_batched_tokens``
budget still allows (whole prompts only when chunked prefill is off), making
sure the pool has room for every scheduled token; if it has none, the newest
running sequence is preempted (its seq_id freed, and it goes back to the front
of the queue to be recomputed) until it does. If nothing was preempted,
waiting sequences are admitted FCFS into what is left of the budget, the
running-set limit and the free KV capacity.

The scheduler knows budgets and order, and talks to the pool only through
``ServingPoolProtocol``: it never sees a tensor or a cache type. It owns the
seq_ids' lifecycle: admission allocates, preemption and ``retire`` free.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from paged_core import OutOfBlocksError
from paged_core.protocols import ServingPoolProtocol
from paged_server.engine.sequence import Sequence, SequenceStatus

# Share of free KV capacity admission leaves for running sequences to grow.
RESERVE_FRACTION = 0.2


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan: ``scheduled`` pairs each sequence with the number of
    tokens it computes this step (running sequences oldest first, then the
    ones admitted this step); room for all of them is reserved."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Waiting queue (FCFS, preempted sequences at the front) and running set
    (in admission order, so the newest is last and is preempted first)."""

    def __init__(
        self,
        pool: ServingPoolProtocol,
        max_batch_size: int,
        max_num_batched_tokens: int,
        block_size: int = 16,
        enable_chunked_prefill: bool = True,
        reserve_fraction: float = RESERVE_FRACTION,
    ) -> None:
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
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
        """A sequence that got its seq_id outside admission (a fork of choice 0)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def requeue_front(self, seq: Sequence) -> None:
        """Put ``seq`` first in the queue (preempted, or a fork that found no seq_id)."""
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
        return sum(s.running_places_needed for s in self.running)

    # -- the step --------------------------------------------------------------
    def retire(self) -> list[Sequence]:
        """Take finished sequences out of the running set and free their
        seq_ids, before scheduling, so the space is reusable at once."""
        retired = [s for s in self.running if s.is_finished]
        if retired:
            self.running = [s for s in self.running if not s.is_finished]
            for seq in retired:
                self._free(seq)
        return retired

    def schedule(self) -> SchedulerOutput:
        """This step's sequences and token counts (see module doc)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        has_prefill = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            wanted = seq.num_tokens - seq.num_computed_tokens
            if seq.is_finished or wanted <= 0:
                i += 1
                continue
            n = min(wanted, budget)
            if n < wanted and not self.enable_chunked_prefill:
                if has_prefill:  # whole prompts only; the first one may overshoot
                    i += 1
                    continue
                n = wanted
            if not self._reserve(seq, seq.num_computed_tokens + n, out):
                break  # ``seq`` itself was the newest and is preempted
            out.scheduled.append((seq, n))
            budget -= n
            has_prefill = has_prefill or n > 1
            i += 1
        if not out.preempted:
            self._admit(budget, has_prefill, out)
        return out

    # -- internals -------------------------------------------------------------
    def _reserve(self, seq: Sequence, upto: int, out: SchedulerOutput) -> bool:
        """Reserve room for ``seq``'s tokens below ``upto``, preempting the
        newest running sequences while the pool is full. ``False`` when
        ``seq`` itself had to go."""
        assert seq.pool_seq_id is not None, f"running sequence {seq.seq_id} has no cache seq_id"
        pool = self.pool
        while (reserved := pool.get_num_reserved(seq.pool_seq_id)) < upto:
            try:
                pool.append_token(seq.pool_seq_id, seq.token_ids[reserved])
                continue
            except OutOfBlocksError:  # all or nothing: the pool is unchanged
                pass
            victim = self._preempt_newest()
            if victim is None:  # cannot happen while ``seq`` runs; be loud if it does
                raise RuntimeError(f"no room for sequence {seq.seq_id} and nothing to preempt")
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt_newest(self) -> Sequence | None:
        """Free the most recently admitted unfinished sequence and put it at
        the front of the queue; its tokens so far are recomputed when it is
        readmitted (less any prefix-cache hits then)."""
        for i in range(len(self.running) - 1, -1, -1):
            seq = self.running[i]
            if not seq.is_finished:
                del self.running[i]
                self._free(seq)
                seq.num_computed_tokens = 0
                self.requeue_front(seq)
                return seq
        return None

    def _admit(self, budget: int, has_prefill: bool, out: SchedulerOutput) -> None:
        """Admit waiting sequences, in order, while they fit: ``max_batch_size``
        running places (a request with ``n`` choices takes ``n``), the token
        budget, and (paged pool) free KV capacity minus a reserve for running
        sequences to grow: the larger of ``reserve_fraction`` of the free
        tokens and one block per running sequence. When nothing runs, the
        head of the queue may use the reserve too, so a large prompt cannot
        wait forever. Stops at the first sequence that does not fit."""
        places = self.max_batch_size - self.num_running_places()
        free_kv = self.pool.free_token_capacity()
        kv_budget: int | None = None
        if free_kv is not None:
            reserve = max(
                free_kv - int(free_kv * (1.0 - self.reserve_fraction)),
                self.block_size * len(self.running),
            )
            kv_budget = free_kv - reserve
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.is_finished:  # e.g. a fork that finished on its first token
                self.waiting.popleft()
                continue
            if seq.running_places_needed > places:
                break
            cost = seq.num_tokens
            if not self.enable_chunked_prefill and cost > budget and has_prefill:
                break
            if kv_budget is not None and free_kv is not None:
                alone = not self.running
                fits = cost <= kv_budget or (alone and cost <= free_kv)
                if not fits and not seq.holds_up_siblings:
                    break
            # Prompt tokens to score must be computed, not read from the cache.
            skip = seq.request.needs_prompt_logprobs
            if not self.pool.can_allocate_sequence(seq.token_ids, skip_prefix_cache=skip):
                break
            seq.pool_seq_id, seq.num_computed_tokens = self.pool.allocate_sequence(
                seq.token_ids, skip_prefix_cache=skip
            )
            self.waiting.popleft()
            self.add_running(seq)
            places -= seq.running_places_needed
            if kv_budget is not None:
                kv_budget -= cost
            wanted = seq.num_tokens - seq.num_computed_tokens
            n = min(wanted, budget) if self.enable_chunked_prefill else wanted
            out.admitted.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
            has_prefill = has_prefill or n > 1

    def _free(self, seq: Sequence) -> None:
        if seq.pool_seq_id is not None:
            self.pool.free_seq(seq.pool_seq_id)
            seq.pool_seq_id = None
