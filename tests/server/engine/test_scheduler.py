"""The token-budget scheduler over real pools: retire -> schedule (running
first, oldest first, preempting the newest when the pool is full) -> admit
FCFS within the budget, the running-set limit and free KV with a reserve;
under the priority policy, by (priority, arrival), the lowest priority
preempted first, and a waiting request of a higher one preempting for room."""

from __future__ import annotations

import torch

from paged_ref import ContiguousKVPool, PagedKVPool
from paged_server.engine.core.scheduler import Scheduler, SchedulerOutput
from paged_server.engine.request.sequence import Request, Sequence, SequenceStatus
from paged_server.sampling_params import SamplingParams

BLOCK = 16


class _NoText:
    def add(self, token_ids: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def paged_pool(num_blocks: int = 64, block_size: int = BLOCK) -> PagedKVPool:
    # Prefix caching off: these prompts share ids, and hits are not the point here.
    return PagedKVPool.from_model_config(
        1, 1, 4, num_blocks, block_size, torch.float32, enable_prefix_caching=False
    )


def make_seq(prompt_len: int, n: int = 1, name: str = "r", priority: int = 0,
             arrival: float = 0.0) -> Sequence:
    request = Request(name, None, list(range(prompt_len)), SamplingParams(n=n), arrival,
                      priority=priority)  # fmt: skip
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


def scheduler(pool, max_batch_size: int = 8, budget: int = 512, **kw) -> Scheduler:
    return Scheduler(pool, max_batch_size, budget, kw.pop("block_size", BLOCK), **kw)


def run_step(sched: Scheduler) -> list[tuple[Sequence, int]]:
    """Schedule, then do what the engine does after a successful pass:
    commit, and give every sequence that is complete a sampled token."""
    return commit(sched, sched.schedule()).scheduled


def commit(sched: Scheduler, plan: SchedulerOutput) -> SchedulerOutput:
    """What the engine does with ``plan`` after a successful pass."""
    for seq, n in plan.scheduled:
        seq.num_computed_tokens += n
        sched.kv_manager.mark_computed(seq.pool_seq_id, seq.num_computed_tokens)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
    return plan


def test_retire_frees_then_admits_and_decodes_take_one_token_each() -> None:
    pool = paged_pool()
    sched = scheduler(pool)
    a, b, c = make_seq(4, name="a"), make_seq(4, name="b"), make_seq(4, name="c")
    for s in (a, b, c):
        sched.add(s)
    assert run_step(sched) == [(a, 4), (b, 4), (c, 4)]
    a.finish("stop")
    seq_id_a = a.pool_seq_id
    assert sched.retire() == [a] and a.pool_seq_id is None
    assert seq_id_a not in pool.block_manager.seq_ids()
    sched.add(d := make_seq(4, name="d"))
    assert run_step(sched) == [(b, 1), (c, 1), (d, 4)]
    assert pool.audit() == []


def test_kv_budget_keeps_a_twenty_percent_reserve() -> None:
    pool = paged_pool(num_blocks=16, block_size=16)  # 256 tokens free
    sched = scheduler(pool, budget=10_000)
    a, b = make_seq(100), make_seq(120)
    sched.add(a)
    sched.add(b)
    # Usable: 256 - max(20% of 256, 0 running blocks) = 205: A (100) fits, B (120) does not.
    assert [s for s, _ in run_step(sched)] == [a]
    assert list(sched.waiting) == [b]


def test_reserve_covers_one_block_per_running_sequence() -> None:
    def admits(prompt_len: int) -> bool:
        pool = paged_pool(num_blocks=40, block_size=4)
        sched = scheduler(pool, max_batch_size=16, block_size=4, budget=10_000)
        for _ in range(10):
            sched.add(make_seq(1))
        run_step(sched)  # 10 sequences, one block each: 30 blocks (120 tokens) free
        sched.add(big := make_seq(prompt_len))
        return big in [s for s, _ in run_step(sched)]

    # 20% of 120 is 24, but 10 running sequences may each need a block (40):
    # 80 tokens are usable, not 96.
    assert admits(80)
    assert not admits(81)


def test_contiguous_pool_checks_only_slots_and_batch_size() -> None:
    pool = ContiguousKVPool.from_model_config(1, 1, 4, 10_001, 2, dtype=torch.float32)
    sched = scheduler(pool, max_batch_size=4, budget=30_000)
    seqs = [make_seq(10_000) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    assert [s for s, _ in run_step(sched)] == seqs[:2]  # two seq_ids
    seqs[0].finish("stop")
    sched.retire()
    assert [s for s, _ in run_step(sched)] == [seqs[1], seqs[2]]


def test_lone_large_prompt_may_use_the_reserve() -> None:
    """Nothing runs: a prompt bigger than 80% of the pool must still start."""
    pool = paged_pool(num_blocks=6, block_size=16)  # 96 tokens
    sched = scheduler(pool)
    sched.add(big := make_seq(90))
    assert run_step(sched) == [(big, 90)]


def test_fcfs_head_of_line_blocks_later_requests() -> None:
    pool = paged_pool(num_blocks=8, block_size=16)
    sched = scheduler(pool)
    sched.add(a := make_seq(100, name="a"))  # 7 blocks: fits alone
    sched.add(b := make_seq(200, name="b"))  # never fits next to a
    sched.add(c := make_seq(4, name="c"))  # would fit, but may not jump the queue
    assert run_step(sched) == [(a, 100)]
    assert list(sched.waiting) == [b, c]


def test_n_choices_take_n_running_places() -> None:
    sched = scheduler(paged_pool(), max_batch_size=4)
    sched.add(group := make_seq(4, n=3))
    sched.add(single := make_seq(4))
    sched.add(pair := make_seq(4, n=2))
    assert [s for s, _ in run_step(sched)] == [group, single]  # 3 + 1 = 4 places
    assert sched.waiting[0] is pair


def test_one_budget_for_decodes_and_prefill_chunks_oldest_first() -> None:
    pool = paged_pool()
    sched = scheduler(pool, budget=12)
    a, b, c = make_seq(10), make_seq(7), make_seq(5)
    for s in (a, b, c):
        sched.add(s)
    assert run_step(sched) == [(a, 10), (b, 2)]  # chunked: the budget is filled exactly
    assert run_step(sched) == [(a, 1), (b, 5), (c, 5)]  # a decodes, b finishes, c starts
    assert run_step(sched) == [(a, 1), (b, 1), (c, 1)]
    assert pool.audit() == []


def test_a_prompt_that_needs_several_chunks_gets_equal_ones() -> None:
    """As many steps as the budget's chunks would take, each carrying an
    equal share: the first token comes no later, and no step carries more
    prompt than it must beside the decodes (9 tokens at a budget of 8 with
    a decode running: 5 + 4, not 7 + 2)."""
    sched = scheduler(paged_pool(), budget=8)
    d = make_seq(3)
    sched.add(d)
    assert run_step(sched) == [(d, 3)]
    p = make_seq(9)
    sched.add(p)
    assert run_step(sched) == [(d, 1), (p, 5)]  # two chunks of at most 7: 5 + 4
    assert run_step(sched) == [(d, 1), (p, 4)]
    assert run_step(sched) == [(d, 1), (p, 1)]  # its first token came after two chunks
    alone = scheduler(paged_pool(), budget=8)
    q = make_seq(17)  # three chunks of at most 8: 6 + 6 + 5, not 8 + 8 + 1
    alone.add(q)
    assert [run_step(alone)[0][1] for _ in range(3)] == [6, 6, 5]


def test_long_prefill_token_threshold_bounds_each_prompt_chunk() -> None:
    """vLLM's ``long_prefill_token_threshold``: at most that many of one
    prompt's tokens per step, admitted or running (in chunks of equal size:
    10 tokens as 4 + 3 + 3); the budget's rest goes to the next sequences;
    decodes are untouched; no effect without chunking."""
    sched = scheduler(paged_pool(), budget=12, long_prefill_token_threshold=4)
    a, b, c = make_seq(10), make_seq(3), make_seq(9)
    for s in (a, b, c):
        sched.add(s)
    assert run_step(sched) == [(a, 4), (b, 3), (c, 3)]
    assert run_step(sched) == [(a, 3), (b, 1), (c, 3)]  # b decodes
    assert run_step(sched) == [(a, 3), (b, 1), (c, 3)]  # each finishes its prompt
    whole = scheduler(paged_pool(), budget=12, enable_chunked_prefill=False,
                      long_prefill_token_threshold=4)  # fmt: skip
    d = make_seq(10)
    whole.add(d)
    assert run_step(whole) == [(d, 10)]


def test_unchunked_prefill_runs_whole_prompts_and_never_starves_the_first() -> None:
    sched = scheduler(paged_pool(), budget=8, enable_chunked_prefill=False)
    a, b = make_seq(10), make_seq(7)
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == [(a, 10)]  # overshoots the budget: nothing else ran
    assert run_step(sched) == [(a, 1), (b, 7)]


def test_full_pool_preempts_the_newest_and_recomputes_it() -> None:
    pool = paged_pool(num_blocks=3, block_size=4)  # 12 tokens
    sched = scheduler(pool, budget=100)
    a, b = make_seq(4, name="a"), make_seq(4, name="b")
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: 2 blocks used, each sequence has 5 tokens now
    run_step(sched)  # a takes the last free block for token 4; b must make room...
    assert sched.running == [a] and list(sched.waiting) == [b]
    assert b.pool_seq_id is None and b.num_computed_tokens == 0 and b.num_tokens == 5
    assert b.status is SequenceStatus.WAITING
    # b's KV is recomputed (prompt + generated) once a finishes and frees blocks.
    a.finish("stop")
    sched.retire()
    assert run_step(sched) == [(b, 5)]
    assert pool.audit() == []


def test_preemption_in_a_step_admits_nothing_new() -> None:
    pool = paged_pool(num_blocks=3, block_size=4)
    sched = scheduler(pool, budget=100)
    a, b = make_seq(4, name="a"), make_seq(4, name="b")
    sched.add(a)
    sched.add(b)
    run_step(sched)
    plan = sched.schedule()
    assert plan.preempted == [b] and plan.admitted == []
    assert [s for s, _ in plan.scheduled] == [a]


def test_priority_policy_orders_the_queue_by_priority_then_arrival() -> None:
    specs = [("a", 10, 0.0), ("b", 10, 1.0), ("c", 0, 2.0), ("d", 0, 3.0), ("e", 5, 4.0)]
    order = {}
    for policy in ("fcfs", "priority"):
        sched = scheduler(paged_pool(), max_batch_size=1, policy=policy)
        for name, priority, arrival in specs:
            sched.add(make_seq(4, name=name, priority=priority, arrival=arrival))
        order[policy] = [s.request.request_id for s in sched.waiting]
    assert order == {"fcfs": ["a", "b", "c", "d", "e"], "priority": ["c", "d", "e", "a", "b"]}


def test_a_waiting_higher_priority_request_preempts_the_lowest_running_one() -> None:
    """One running place: ``c`` (priority 0) arrives while ``a`` (10) runs and
    ``b`` (5) waits. ``c`` takes the place at once; ``a`` is recomputed later,
    behind ``b``. A later peer of ``c`` (``d``, priority 0) waits: a request is
    never preempted for one of its own priority."""
    sched = scheduler(paged_pool(), max_batch_size=1, policy="priority")
    sched.add(a := make_seq(4, name="a", priority=10, arrival=0.0))
    assert run_step(sched) == [(a, 4)]
    sched.add(b := make_seq(4, name="b", priority=5, arrival=1.0))
    sched.add(c := make_seq(4, name="c", priority=0, arrival=2.0))
    plan = commit(sched, sched.schedule())
    assert plan.preempted == [a] and plan.admitted == [c]
    assert plan.scheduled == [(c, 4)]  # a's decode was taken back
    assert list(sched.waiting) == [b, a] and a.num_computed_tokens == 0
    sched.add(d := make_seq(4, name="d", priority=0, arrival=3.0))
    plan = sched.schedule()
    assert plan.preempted == [] and plan.scheduled == [(c, 1)]
    assert list(sched.waiting) == [d, b, a]
    assert sched.kv_manager.audit() == []


def test_fcfs_never_preempts_for_a_waiting_request() -> None:
    sched = scheduler(paged_pool(), max_batch_size=1)
    sched.add(a := make_seq(4, name="a", arrival=0.0))
    run_step(sched)
    sched.add(c := make_seq(4, name="c", arrival=2.0))
    plan = sched.schedule()
    assert plan.preempted == [] and plan.scheduled == [(a, 1)] and list(sched.waiting) == [c]


def grow_until_preempted(policy: str, num_blocks: int, prompts: tuple[int, int, int]):
    """``a`` (priority 10 under the priority policy) runs alone, then ``b``
    and ``c`` (priority 0) join; all decode on a pool of 4-token blocks until
    one needs a block with none free. Returns that step's plan, the three
    sequences and the pool."""
    pool = paged_pool(num_blocks=num_blocks, block_size=4)
    sched = scheduler(pool, budget=100, block_size=4, policy=policy)
    sched.add(a := make_seq(prompts[0], name="a", priority=10 if policy == "priority" else 0))
    run_step(sched)
    sched.add(b := make_seq(prompts[1], name="b", arrival=1.0))
    sched.add(c := make_seq(prompts[2], name="c", arrival=2.0))
    assert run_step(sched) == [(a, 1), (b, prompts[1]), (c, prompts[2])]
    for _ in range(8):
        plan = sched.schedule()
        if plan.preempted:
            return plan, (a, b, c), pool
        commit(sched, plan)
    raise AssertionError("nothing was preempted")


def test_a_full_pool_preempts_the_lowest_priority_not_the_newest() -> None:
    """``b`` is first to need a block: fcfs preempts the newest (``c``); the
    priority policy preempts ``a``, which ran before ``b``: its decode this
    step is taken back, and ``c``, after ``b``, still runs."""
    plan, (a, b, c), pool = grow_until_preempted("fcfs", 5, (3, 5, 1))
    assert plan.preempted == [c] and plan.scheduled == [(a, 1), (b, 1)]
    plan, (a, b, c), pool = grow_until_preempted("priority", 5, (3, 5, 1))
    assert plan.preempted == [a] and plan.scheduled == [(b, 1), (c, 1)]
    assert pool.audit() == []


def test_the_lowest_priority_asking_for_room_goes_and_the_rest_still_run() -> None:
    """``a`` is first to need a block and is itself the lowest priority: it
    goes, and ``b`` and ``c`` (after it in the running set) still run."""
    plan, (a, b, c), pool = grow_until_preempted("fcfs", 6, (4, 5, 2))
    assert plan.preempted == [c] and plan.scheduled == [(a, 1), (b, 1)]
    plan, (a, b, c), pool = grow_until_preempted("priority", 6, (4, 5, 2))
    assert plan.preempted == [a] and plan.scheduled == [(b, 1), (c, 1)]
    assert pool.audit() == []


def test_a_higher_priority_request_that_finds_no_kv_room_preempts_for_it() -> None:
    """A pool of 8 blocks of 4 (32 tokens), a low-priority sequence of 20
    tokens holding most of it: a priority-0 prompt of 16 tokens cannot be
    admitted beside it, so it preempts it and runs."""
    pool = paged_pool(num_blocks=8, block_size=4)
    sched = scheduler(pool, budget=100, policy="priority")
    sched.add(low := make_seq(20, name="low", priority=3))
    run_step(sched)
    sched.add(high := make_seq(16, name="high", priority=1, arrival=1.0))
    plan = sched.schedule()
    assert plan.preempted == [low] and plan.scheduled == [(high, 16)]
    assert pool.audit() == []
