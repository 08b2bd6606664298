"""The scheduler: one token budget per step, shared by decodes and prefill chunks.

Every running sequence wants ``num_tokens - num_computed_tokens`` tokens
computed: 1 for a decode, a chunk of its prompt while prefilling, its whole
history after a preemption. Each step the scheduler walks the running set
oldest first and gives each sequence what the ``max_num_batched_tokens``
budget still allows (a prompt that needs several chunks in chunks of equal
size; whole prompts only when chunked prefill is off), making
sure the pool has room for every scheduled token; if it has none, the newest
running *unit* is preempted (its seq_ids freed, and it goes back to the front
of the queue to be recomputed) until it does. If nothing was preempted,
waiting units are admitted FCFS into what is left of the budget, the
running-set limit and the free KV capacity.

A unit is what must run together: the beams of a beam search (they advance
in lock step, so a beam left waiting while its siblings hold their blocks
could wait forever), else one sequence. Units are admitted, preempted and
readmitted whole, and the running set keeps each unit's sequences together
in admission order. Admission reserves a sequence's prompt (all of it, at
once) and, past the prompt, only the chunk it computes; later chunks are
reserved as they are scheduled. So a preempted sequence of a hybrid model
comes back holding, in its sliding-window groups, only the window and the
chunk in flight, as it did before, not its whole history in every group.
Where the newest unit is the one asking, a chunk shrinks to what fits
instead of preempting its own unit.

Progress guarantee: a unit that cannot be given room with nothing else
running (the pool as free as it gets) never will be; it is refused
(``SchedulerOutput.refused``) and the engine fails its request with the
reason, rather than waiting forever. Submission checks
(``checks.check_prompt``) make this rare.

Priority scheduling (``policy="priority"``, vLLM's ``--scheduling-policy
priority``): the queue is ordered by (priority, arrival), lower values
first, and the unit preempted when the pool is full is the lowest-priority
one (highest value, newest among equals), as vLLM's v1 scheduler picks it.
A waiting unit that finds no room (running places or KV) also preempts the
lowest-priority running units whose priority value is strictly higher than
its own (vLLM V0's priority policy; v1 lets it wait): never one of its own priority, so equal
priorities keep first come, first served and nothing is preempted to admit
its peer. Under ``fcfs`` the priority is not read at all.

With LoRA adapters (``max_loras``), the running set holds the requests of
at most ``max_loras`` distinct adapters (the device slots of one step, as
vLLM's scheduler): a waiting request of another adapter is passed over,
keeping its place, and later ones of adapters already running (or of the
base model) are admitted; it runs once an adapter's requests are done.

The scheduler knows budgets and order, and talks to the KV cache only
through its manager (``KVCacheManagerProtocol``): it never sees a tensor or
a cache type. It owns the
seq_ids' lifecycle: admission allocates, preemption and ``retire`` free.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from paged_core.protocols import KVCacheManagerProtocol
from paged_server.config import SCHEDULING_POLICIES
from paged_server.engine.request.sequence import Sequence, SequenceStatus

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
    # Units that can never run, with why: the engine fails their requests.
    refused: list[tuple[Sequence, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Waiting queue (FCFS, preempted units at the front; by priority, then
    arrival, under ``policy="priority"``) and running set (in admission
    order, a unit's sequences together, so the newest unit is last and is
    preempted first, under ``fcfs``)."""

    def __init__(
        self,
        kv_manager: KVCacheManagerProtocol,
        max_batch_size: int,
        max_num_batched_tokens: int,
        block_size: int = 16,
        enable_chunked_prefill: bool = True,
        reserve_fraction: float = RESERVE_FRACTION,
        long_prefill_token_threshold: int = 0,
        max_loras: int | None = None,
        policy: str = "fcfs",
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy: must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        self.kv_manager = kv_manager
        self.by_priority = policy == "priority"
        self.max_loras = max_loras  # distinct LoRA adapters running at once (None: no adapters)
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.enable_chunked_prefill = enable_chunked_prefill
        self.reserve_fraction = reserve_fraction
        # A prompt's chunk per step, at most (0: the budget's rest); chunked prefill only.
        self.max_chunk = long_prefill_token_threshold if enable_chunked_prefill else 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # -- queue -----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence behind everything already waiting (by
        priority: behind everything of its priority or a higher one)."""
        seq.status = SequenceStatus.WAITING
        if self.by_priority:
            bisect.insort_right(self.waiting, seq, key=_rank)  # type: ignore[arg-type]
        else:
            self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that got its seq_id (admitted, or a fork of a running
        one): it runs after the running sequences of its own request, so a
        request's sequences stay together and age with it."""
        seq.status = SequenceStatus.RUNNING
        if len(seq.request.seqs) > 1:
            for i in range(len(self.running) - 1, -1, -1):
                if self.running[i].request is seq.request:
                    self.running.insert(i + 1, seq)
                    return
        self.running.append(seq)

    def requeue_front(self, seq: Sequence) -> None:
        """Put ``seq`` first in the queue (preempted, or a fork that found no
        seq_id); by priority: first among its priority's later arrivals."""
        seq.status = SequenceStatus.WAITING
        if self.by_priority:
            bisect.insort_left(self.waiting, seq, key=_rank)  # type: ignore[arg-type]
        else:
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
        reserve, finished = self.kv_manager.reserve, SequenceStatus.FINISHED
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # seq.scheduled_upto, seq.planned_tokens and seq.is_finished, read
            # inline: as properties, the reads cost ~40 us more a step at 256
            # sequences (host critical path).
            done = seq.num_computed_tokens + seq.num_inflight_tokens
            pending = seq.num_pending_samples
            wanted = len(seq.token_ids) + pending + len(seq.draft) - done
            if seq.status is finished or wanted <= 0 or (pending and _samples_its_last(seq)):
                i += 1
                continue
            # Most of a step: a decode whose room is there (no chunk, nothing to preempt).
            if wanted == 1 and reserve(seq.pool_seq_id, seq.token_ids, done + 1) > done:  # type: ignore[arg-type]
                out.scheduled.append((seq, 1))
                budget -= 1
                i += 1
                continue
            n = self._chunk(wanted, budget)
            if n < wanted and not self.enable_chunked_prefill:
                if has_prefill:  # whole prompts only; the first one may overshoot
                    i += 1
                    continue
                n = wanted
            preempted, later = len(out.preempted), self.running[i + 1 :] if self.by_priority else []
            n = self._reserve(seq, n, out)
            if self.by_priority and len(out.preempted) > preempted:
                # The lowest-priority unit may have run before ``seq`` (its tokens
                # come back) or be ``seq``'s own, with units after it still to run.
                budget = self.max_num_batched_tokens - out.num_tokens
                if n is None:
                    i = next((self.running.index(s) for s in later if s in self.running), len(self.running))
                    continue
                i = self.running.index(seq)
            if n is None:  # ``seq``'s own unit was the newest and had to go
                break
            if n:
                out.scheduled.append((seq, n))
                budget -= n
                has_prefill = has_prefill or n > 1
            i += 1
        if self.waiting and not out.preempted and not out.refused:
            self._admit(budget, has_prefill, out)
        return out

    # -- internals -------------------------------------------------------------
    def _chunk(self, wanted: int, budget: int) -> int:
        """Tokens one sequence computes this step: what it wants, within the
        step's budget and ``long_prefill_token_threshold`` (which bounds a
        prompt chunk, so a step that carries one stays short for the decodes
        beside it: steadier inter-token latency, later first tokens). What
        needs several chunks of that size gets as many, of equal size: the
        same steps to its first token, and no step carries more than it must
        (311 tokens beside 3 decodes at a budget of 256: 156 + 155, not 253 + 58).
        0 once the budget is spent: a beam readmitted with siblings that took
        the rest of it holds its room and computes next step."""
        cap = min(budget, self.max_chunk) if self.max_chunk else budget
        if cap <= 0:
            return 0
        if wanted <= cap:
            return wanted
        return -(-wanted // -(-wanted // cap))  # ceil(wanted / number of chunks)

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> int | None:
        """Reserve room for ``seq``'s next ``n`` tokens, preempting the newest
        running units while the pool is full. Returns how many it computes:
        ``n``; fewer when its own unit is the newest (the chunk shrinks to what
        fits); 0 when what fits went to its unit's siblings this step (it
        follows next step); ``None`` when its unit had to go."""
        assert seq.pool_seq_id is not None, f"running sequence {seq.seq_id} has no cache seq_id"
        done = seq.scheduled_upto
        upto = done + n
        while (reserved := self.kv_manager.reserve(seq.pool_seq_id, seq.token_ids, upto)) < upto:
            unit = self._unit(self._lowest(), self.running)
            if seq not in unit:
                self._preempt(unit, out)
                continue
            if reserved > done:
                return reserved - done
            if any(s in unit for s, _ in out.scheduled):
                return 0
            if all(s in unit or s.is_finished for s in self.running):  # nothing else to free
                self._refuse(unit, out, "could not grow by one token with nothing else running")
            else:
                self._preempt(unit, out)
            return None
        return n

    def _lowest(self) -> Sequence:
        """The running sequence whose unit goes first when the pool is full:
        the newest; by priority, the lowest-priority (newest among equals)."""
        live = (s for s in reversed(self.running) if not s.is_finished)
        seq = max(live, key=_rank, default=None) if self.by_priority else next(live, None)
        if seq is None:  # cannot happen while a sequence asks for room; be loud if it does
            raise RuntimeError("no room in the KV cache and nothing running to preempt")
        return seq

    def _make_room_for(self, seq: Sequence, out: SchedulerOutput) -> int | None:
        """By priority: preempt the lowest-priority running unit if its
        priority value is strictly higher than ``seq``'s (never a peer: no
        thrashing); returns the step's tokens it gives back, None when there
        is no such unit (or under fcfs)."""
        if not self.by_priority or not any(not s.is_finished for s in self.running):
            return None
        victim = self._lowest()
        if victim.request.priority <= seq.request.priority:
            return None
        unit = self._unit(victim, self.running)
        # The queue is in priority order, so what this step admitted ranks above seq.
        assert not any(s in out.admitted for s in unit), "preempting a unit admitted this step"
        tokens = sum(n for s, n in out.scheduled if s in unit)
        self._preempt(unit, out)
        return tokens

    @staticmethod
    def _unit(seq: Sequence, among: list[Sequence] | deque[Sequence]) -> list[Sequence]:
        """``seq`` and the sequences of ``among`` that must run with it, in order."""
        if not seq.moves_with_siblings:
            return [seq]
        return [s for s in among if s.request is seq.request and not s.is_finished]

    def _preempt(self, unit: list[Sequence], out: SchedulerOutput) -> None:
        """Free ``unit``'s seq_ids and put it at the front of the queue; its
        tokens so far are recomputed when it is readmitted (less any
        prefix-cache hits then). Anything of it already scheduled this step
        is taken back."""
        for seq in unit:
            self.running.remove(seq)
            self._free(seq)
            seq.num_computed_tokens = seq.num_inflight_tokens = seq.num_pending_samples = 0
            seq.num_preemptions += 1  # a step in flight drops its results for it
        for seq in reversed(unit):
            self.requeue_front(seq)
        unit[0].request.beam_rows.clear()  # every beam recomputes its row
        out.preempted += unit
        out.scheduled = [(s, n) for s, n in out.scheduled if s not in unit]

    def _refuse(self, unit: list[Sequence], out: SchedulerOutput, why: str) -> None:
        """Take ``unit`` out for good (it can never run); the engine fails it."""
        request = unit[0].request
        tokens = sum(s.num_tokens for s in unit)
        free = self.kv_manager.free_token_capacity()
        room = f"{free} tokens of KV cache free" if free is not None else (
            f"{self.kv_manager.free_seq_count()} cache rows free"
        )
        reason = (
            f"request {request.request_id!r} can never be scheduled: its {len(unit)} "
            f"sequence(s) of {tokens} tokens in all {why} ({room}); lower max_tokens, "
            "best_of or n, or raise num_gpu_blocks / kv_cache_memory_bytes"
        )
        for seq in unit:
            if seq in self.running:
                self.running.remove(seq)
                self._free(seq)
            else:
                self.remove_waiting(seq)
            out.refused.append((seq, reason))
        out.scheduled = [(s, n) for s, n in out.scheduled if s not in unit]

    def _admit(self, budget: int, has_prefill: bool, out: SchedulerOutput) -> None:
        """Admit waiting units, in order, while they fit: ``max_batch_size``
        running places (a request with ``n`` choices takes ``n``), the token
        budget, and (paged pool) free KV capacity minus a reserve for running
        sequences to grow: the larger of ``reserve_fraction`` of the free
        tokens and one block per running sequence. When nothing runs, the
        head of the queue may use every free block, so a large prompt cannot
        wait forever; if even then it cannot be allocated, it is refused.
        Stops at the first unit that does not fit (by priority: once no
        lower-priority unit is left to preempt for it)."""
        places, kv_budget = self._room()
        loras = self._running_loras()
        passed: set[int] = set()  # ids of requests passed over for their LoRA adapter
        i = 0
        while i < len(self.waiting) and budget > 0:
            seq = self.waiting[i]
            if seq.is_finished:  # e.g. a fork that finished on its first token
                del self.waiting[i]
                continue
            lora = seq.request.lora_name
            if id(seq.request) in passed or (
                lora is not None and lora not in loras and len(loras) >= self.max_loras  # type: ignore[operator]
            ):  # every slot's adapter has requests running: it waits, keeping its place
                passed.add(id(seq.request))
                i += 1
                continue
            unit = self._unit(seq, self.waiting)
            cost = sum(s.num_tokens for s in unit)
            if not self.enable_chunked_prefill and cost > budget and has_prefill:
                break
            alone = not self.running
            if sum(s.running_places_needed for s in unit) > places or (
                kv_budget is not None and cost > kv_budget and not alone
            ):  # no room: by priority, lower-priority units make way, one at a time
                if (given_back := self._make_room_for(seq, out)) is None:
                    break
                budget += given_back
                places, kv_budget = self._room()
                continue
            # Prompt tokens to score or pool must be computed, not read from the cache.
            skip = seq.request.skips_prefix_cache
            prompt = seq.num_prompt_tokens  # reserved at once; the rest chunk by chunk
            histories = [s.token_ids for s in unit]
            key = seq.request.lora_key  # one adapter's KV never serves another (or the base)
            if not self.kv_manager.can_allocate_sequences(
                histories, skip_prefix_cache=skip, num_reserved=prompt, extra_key=key
            ):
                if alone:
                    self._refuse(unit, out, "do not fit the KV cache even with nothing else running")
                    continue
                if (given_back := self._make_room_for(seq, out)) is None:
                    break
                budget += given_back
                places, kv_budget = self._room()
                continue
            for s in unit:
                self.remove_waiting(s)
                s.pool_seq_id, s.num_computed_tokens = self.kv_manager.allocate_sequence(
                    s.token_ids, skip_prefix_cache=skip, num_reserved=prompt, extra_key=key
                )
                self.add_running(s)
                places -= s.running_places_needed
            if kv_budget is not None:
                kv_budget -= cost
            if lora is not None:
                loras.add(lora)
            for s in unit:
                wanted = s.num_tokens - s.num_computed_tokens
                n = self._chunk(wanted, budget) if self.enable_chunked_prefill else wanted
                if n:  # the prompt is reserved; a recompute past it gets what fits
                    upto, seq_id = s.num_computed_tokens + n, s.pool_seq_id
                    assert seq_id is not None  # allocated above
                    reserved = self.kv_manager.reserve(seq_id, s.token_ids, upto)
                    n = min(n, reserved - s.num_computed_tokens)
                out.admitted.append(s)
                if n:
                    out.scheduled.append((s, n))
                    budget -= n
                    has_prefill = has_prefill or n > 1

    def _room(self) -> tuple[int, int | None]:
        """Admission's room: running places left, and (paged pool) the free KV
        tokens past the reserve running sequences keep to grow."""
        places = self.max_batch_size - self.num_running_places()
        free_kv = self.kv_manager.free_token_capacity()
        if free_kv is None:
            return places, None
        reserve = max(
            free_kv - int(free_kv * (1.0 - self.reserve_fraction)),
            self.block_size * len(self.running),
        )
        return places, free_kv - reserve

    def _running_loras(self) -> set[str]:
        """The LoRA adapters of the running set's unfinished sequences."""
        if self.max_loras is None:
            return set()
        return {s.request.lora_name for s in self.running if s.request.lora_name and not s.is_finished}

    def _free(self, seq: Sequence) -> None:
        if seq.pool_seq_id is not None:
            self.kv_manager.free_seq(seq.pool_seq_id)
            seq.pool_seq_id = None


def _rank(seq: Sequence) -> tuple[int, float]:
    """Priority order: lower priority values first, then earlier arrivals."""
    return seq.request.priority, seq.request.arrival_time


def _samples_its_last(seq: Sequence) -> bool:
    """Whether the token being sampled for ``seq`` (a step in flight) is its
    last (``max_tokens``): then nothing of it is computed after it."""
    generated = len(seq.token_ids) + seq.num_pending_samples - seq.num_prompt_tokens
    return generated >= seq.request.params.max_tokens  # type: ignore[operator]
