"""The split scheduler of the design documents: retire -> admit(budget) ->
decode / prefill, FCFS, block budget with reserve, chunking, preemption order."""

from __future__ import annotations

import torch

from paged_server.sampling_params import SamplingParams
from paged_server.scheduler import Scheduler
from paged_server.sequence import Request, Sequence, SequenceStatus


class _NoText:
    def add(self, token_ids: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def make_seq(prompt_len: int, n: int = 1, name: str = "r") -> Sequence:
    request = Request(name, None, list(range(prompt_len)), SamplingParams(n=n), 0.0)
    for i in range(n):
        request.seqs.append(
            Sequence(
                seq_id=i,
                request=request,
                index=i,
                token_ids=list(range(prompt_len)),
                generator=torch.Generator(),
                text_stream=_NoText(),
                status=SequenceStatus.WAITING if i == 0 else SequenceStatus.PENDING_FORK,
            )
        )
    return request.seqs[0]


def finish_prefill(*seqs: Sequence) -> None:
    for s in seqs:
        s.num_computed = s.prefill_len
        s.token_ids.append(7)  # first sampled token


def test_split_retire_admit_decode() -> None:
    sched = Scheduler(max_batch_size=8)
    a, b, c = make_seq(4, name="a"), make_seq(4, name="b"), make_seq(4, name="c")
    for s in (a, b, c):
        sched.add(s)
    assert sched.retire() == []
    assert sched.admit() == [a, b, c]
    finish_prefill(a, b, c)
    a.finish("stop")
    assert sched.retire() == [a]
    assert sched.admit() == []
    d = make_seq(4, name="d")
    sched.add(d)
    assert sched.admit() == [d]
    assert sched.decode_sequences() == [b, c]


def test_block_budget_keeps_a_twenty_percent_reserve() -> None:
    sched = Scheduler(max_batch_size=8, block_size=16)
    a, b, c = make_seq(100), make_seq(200), make_seq(300)
    for s in (a, b, c):
        sched.add(s)
    assert sched.admit(free_kv_tokens=250) == [a]  # usable 200: B (200) does not fit after A
    assert sched.admit(free_kv_tokens=625) == [b, c]  # usable 500 = 200 + 300


def test_reserve_covers_one_block_per_running_sequence() -> None:
    sched = Scheduler(max_batch_size=16, block_size=16)
    running = [make_seq(1) for _ in range(10)]
    for s in running:
        sched.add(s)
    assert len(sched.admit()) == 10
    sched.add(big := make_seq(300))
    # 20% of 400 is 80, but 10 running sequences may each need a block (160).
    assert sched.admit(free_kv_tokens=400) == []
    assert sched.admit(free_kv_tokens=460) == [big]


def test_block_budget_zero_admits_nothing() -> None:
    sched = Scheduler(max_batch_size=8)
    sched.add(make_seq(1))
    assert sched.admit(free_kv_tokens=0) == []
    assert len(sched.waiting) == 1


def test_budget_none_for_contiguous_checks_only_batch_size() -> None:
    sched = Scheduler(max_batch_size=2)
    seqs = [make_seq(10_000) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    assert sched.admit(free_kv_tokens=None) == seqs[:2]
    seqs[0].finish("stop")
    sched.retire()
    assert sched.admit(free_kv_tokens=None) == [seqs[2]]


def test_lone_large_prompt_may_use_the_reserve() -> None:
    """Nothing runs: a prompt bigger than 80% of the pool must still start."""
    sched = Scheduler(max_batch_size=4)
    sched.add(big := make_seq(90))
    assert sched.admit(free_kv_tokens=100) == [big]


def test_fcfs_head_of_line_blocks_and_allocate_can_refuse() -> None:
    sched = Scheduler(max_batch_size=8)
    a, b = make_seq(4, name="a"), make_seq(4, name="b")
    sched.add(a)
    sched.add(b)
    assert sched.admit(allocate=lambda s: s is not a) == []  # b may not jump the queue
    assert sched.admit(allocate=lambda s: True) == [a, b]


def test_n_choices_take_n_running_places() -> None:
    sched = Scheduler(max_batch_size=4)
    sched.add(group := make_seq(4, n=3))
    sched.add(single := make_seq(4))
    sched.add(pair := make_seq(4, n=2))
    assert sched.admit() == [group, single]  # 3 + 1 = 4 places; the pair waits
    assert sched.waiting[0] is pair


def test_chunked_prefill_fills_the_token_budget_oldest_first() -> None:
    sched = Scheduler(max_batch_size=8, enable_chunked_prefill=True)
    a, b, c = make_seq(10), make_seq(7), make_seq(5)
    for s in (a, b, c):
        sched.add(s)
    sched.admit()
    chunks = sched.schedule_prefill(token_budget=12)
    assert [(s, n) for s, n in chunks] == [(a, 10), (b, 2)]
    a.num_computed, b.num_computed = 10, 2
    assert sched.schedule_prefill(token_budget=12) == [(b, 5), (c, 5)]


def test_unchunked_prefill_runs_whole_prompts_and_never_starves_the_first() -> None:
    sched = Scheduler(max_batch_size=8, enable_chunked_prefill=False)
    a, b = make_seq(10), make_seq(7)
    for s in (a, b):
        sched.add(s)
    sched.admit()
    assert sched.schedule_prefill(token_budget=8) == [(a, 10)]
    assert sched.schedule_prefill(token_budget=17) == [(a, 10), (b, 7)]


def test_preempt_newest_requeues_at_the_front_in_admission_order() -> None:
    sched = Scheduler(max_batch_size=8)
    a, b, c = make_seq(4, name="a"), make_seq(4, name="b"), make_seq(4, name="c")
    for s in (a, b, c):
        sched.add(s)
    sched.admit()
    finish_prefill(a, b, c)
    sched.add(late := make_seq(4, name="late"))
    assert sched.preempt_newest() is c
    assert sched.preempt_newest() is b
    assert list(sched.waiting) == [b, c, late]
    assert b.num_computed == 0 and b.prefill_len == 0 and len(b.token_ids) == 5
    assert sched.running == [a]
    # Readmitted, its prefill covers prompt + generated tokens (recompute).
    assert sched.admit() == [b, c, late]
    assert b.prefill_len == 5 and b.is_prefilling
