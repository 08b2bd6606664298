"""The paged pool's incremental page tables (host tensor rows updated only
where a table changes) always equal tables rebuilt from the block manager's
lists, across random admissions with prefix hits, decode growth,
copy-on-write forks, frees and preemptions."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_core import OutOfBlocksError
from paged_ref import PagedKVPool

BLOCK = 4
OPS = ("admit", "append", "fork", "free", "preempt", "commit")
op_lists = st.lists(
    st.tuples(st.sampled_from(OPS), st.integers(0, 1 << 16), st.integers(1, 14)),
    min_size=80,  # x 25 examples: at least 2,000 operations per run
    max_size=140,
)


def rebuilt(pool: PagedKVPool, seq_ids: list[int], width: int) -> torch.Tensor:
    """Tables from scratch: the block manager's lists, padded."""
    out = torch.zeros(len(seq_ids), width, dtype=torch.int32)
    for i, seq_id in enumerate(seq_ids):
        table = pool.block_manager.block_table(seq_id)[:width]
        out[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return out


@settings(max_examples=25, deadline=None)
@given(ops=op_lists)
def test_incremental_tables_equal_rebuilt_tables(ops) -> None:
    pool = PagedKVPool.from_model_config(1, 1, 4, 24, BLOCK, torch.float32)
    live: dict[int, list[int]] = {}  # seq_id -> its token ids
    for op, pick, length in ops:
        seq_ids = sorted(live)
        seq_id = seq_ids[pick % len(seq_ids)] if seq_ids else None
        try:
            if op == "admit" or seq_id is None:
                # Few distinct prefixes, so later prompts hit earlier blocks.
                tokens = [(pick % 3) * 100 + t for t in range(length)]
                if pool.can_allocate_sequence(tokens):
                    new, _ = pool.allocate_sequence(tokens)
                    live[new] = tokens
            elif op == "append":
                token = pick % 50
                pool.append_token(seq_id, token)
                live[seq_id].append(token)
            elif op == "fork":
                child = pool.fork_seq(seq_id)
                live[child] = list(live[seq_id])
            elif op == "free" or op == "preempt":
                pool.free_seq(seq_id)
                del live[seq_id]
            else:  # everything reserved is now written: its full blocks may be cached
                pool.mark_computed(seq_id, pool.get_num_reserved(seq_id))
        except OutOfBlocksError:
            pass  # a full pool refuses; nothing may have changed
        assert pool.audit() == []  # includes the mirror-vs-block-manager check
        seq_ids = sorted(live)
        if seq_ids:
            ends = [pool.get_num_reserved(s) for s in seq_ids]
            starts = [max(0, e - 1) for e in ends]
            meta = pool.build_metadata(seq_ids, starts, [e - s for s, e in zip(starts, ends, strict=True)])
            width = meta.block_tables.shape[1]
            # Entries past a table's end are stale by design: compare the used ones.
            used = torch.arange(width) < torch.tensor([-(-e // BLOCK) for e in ends]).unsqueeze(1)
            torch.testing.assert_close(
                meta.block_tables[used], rebuilt(pool, seq_ids, width)[used], atol=0, rtol=0
            )

