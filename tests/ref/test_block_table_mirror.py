"""The paged pool's incremental page tables (host tensor rows updated only
where a table changes) always equal tables rebuilt from the block manager's
lists, across random admissions with prefix hits, decode growth,
copy-on-write forks, frees and preemptions."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_core import OutOfBlocksError
from paged_ref import PagedKVCachePool

BLOCK = 4
OPS = ("admit", "append", "fork", "free", "preempt", "commit")
op_lists = st.lists(
    st.tuples(st.sampled_from(OPS), st.integers(0, 1 << 16), st.integers(1, 14)),
    min_size=80,  # x 25 examples: at least 2,000 operations per run
    max_size=140,
)


def rebuilt(pool: PagedKVCachePool, slots: list[int], width: int) -> torch.Tensor:
    """Tables from scratch: the block manager's lists, padded."""
    out = torch.zeros(len(slots), width, dtype=torch.int32)
    for i, slot in enumerate(slots):
        table = pool.block_manager.block_table(slot)[:width]
        out[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return out


@settings(max_examples=25, deadline=None)
@given(ops=op_lists)
def test_incremental_tables_equal_rebuilt_tables(ops) -> None:
    pool = PagedKVCachePool.from_model_config(1, 1, 4, 24, BLOCK, torch.float32)
    live: dict[int, list[int]] = {}  # slot -> its token ids
    for op, pick, length in ops:
        slots = sorted(live)
        slot = slots[pick % len(slots)] if slots else None
        try:
            if op == "admit" or slot is None:
                # Few distinct prefixes, so later prompts hit earlier blocks.
                tokens = [(pick % 3) * 100 + t for t in range(length)]
                if pool.can_allocate_sequence(tokens):
                    new, _ = pool.allocate_sequence(tokens)
                    live[new] = tokens
            elif op == "append":
                token = pick % 50
                pool.append_token(slot, token)
                live[slot].append(token)
            elif op == "fork":
                child = pool.fork_slot(slot)
                live[child] = list(live[slot])
            elif op == "free":
                pool.free_slot(slot)
                del live[slot]
            elif op == "preempt":
                pool.preempt(slot)
                del live[slot]
            else:  # everything reserved is now written: its full blocks may be cached
                pool.mark_computed(slot, pool.get_num_reserved(slot))
        except OutOfBlocksError:
            pass  # a full pool refuses; nothing may have changed
        assert pool.audit() == []  # includes the mirror-vs-block-manager check
        slots = sorted(live)
        if slots:
            ends = [pool.get_num_reserved(s) for s in slots]
            starts = [max(0, e - 1) for e in ends]
            meta = pool.build_metadata(slots, starts, [e - s for s, e in zip(starts, ends, strict=True)], False)
            width = meta.block_tables.shape[1]
            # Entries past a table's end are stale by design: compare the used ones.
            used = torch.arange(width) < torch.tensor([-(-e // BLOCK) for e in ends]).unsqueeze(1)
            torch.testing.assert_close(
                meta.block_tables[used], rebuilt(pool, slots, width)[used], atol=0, rtol=0
            )

