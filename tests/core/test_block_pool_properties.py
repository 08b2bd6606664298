"""Random take / acquire / register / free / reclaim sequences against a model of the pool.

The model is a dict of reference counts, the free queue as a plain list
(front = next handed out) and the prefix index; after every operation the
pool must agree with it exactly, and its audit must be clean.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_core import BlockPool, OutOfBlocksError
from paged_core.block_pool import hash_block_tokens

TOTAL = 12
MIN_OPS = 40
EXAMPLES = 60  # >= 60 * 40 = 2,400 operations per run

block_id = st.integers(0, TOTAL - 1)
op = st.one_of(
    st.tuples(st.just("take"), st.integers(0, 5)),
    st.tuples(st.just("acquire"), block_id),
    st.tuples(st.just("register"), block_id, st.integers(0, 5)),
    st.tuples(st.just("free"), block_id),
    st.tuples(st.just("free_many"), block_id),
    st.tuples(st.just("reclaim"), block_id),
)


def key(tag: int) -> bytes:
    return hash_block_tokens(None, [tag, tag])


class PoolModel:
    """What the pool should hold."""

    def __init__(self, total: int) -> None:
        self.refs: dict[int, int] = {}
        self.queue: list[int] = list(range(total))
        self.index: dict[bytes, int] = {}  # key -> block id
        self.evictions = 0

    def uncache(self, b: int) -> None:
        self.index = {k: v for k, v in self.index.items() if v != b}

    def release(self, b: int) -> None:
        """Back of the queue if cached, front otherwise."""
        del self.refs[b]
        if b in self.index.values():
            self.queue.append(b)
        else:
            self.queue.insert(0, b)


def check(pool: BlockPool, model: PoolModel) -> None:
    assert [b.block_id for b in pool.free_queue] == model.queue
    for block in pool.blocks:
        assert block.ref_count == model.refs.get(block.block_id, 0)
    assert {k: b.block_id for (_, k), b in pool.prefix_index.items()} == model.index
    assert pool.num_cached_free == sum(1 for b in model.queue if b in model.index.values())
    assert pool.evictions == model.evictions
    tables = [[pool.blocks[b]] * n for b, n in model.refs.items()]
    assert pool.audit(tables, 2) == []


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=MIN_OPS, max_size=80))
def test_random_operations_agree_with_model(ops):
    assert len(ops) >= MIN_OPS
    pool = BlockPool(TOTAL)
    model = PoolModel(TOTAL)
    for name, arg, *rest in ops:
        block = pool.blocks[arg] if name != "take" else None
        if name == "take":
            if arg > len(model.queue):
                with pytest.raises(OutOfBlocksError):
                    pool.get_new_blocks(arg)
            else:
                got = [b.block_id for b in pool.get_new_blocks(arg)]
                assert got == model.queue[:arg]
                for b in got:
                    if b in model.index.values():
                        model.uncache(b)
                        model.evictions += 1
                    model.refs[b] = 1
                del model.queue[:arg]
        elif name == "acquire":
            assert block is not None
            pool.acquire(block)
            if arg not in model.refs:
                model.queue.remove(arg)  # a hit: out of the middle, content kept
            model.refs[arg] = model.refs.get(arg, 0) + 1
        elif name == "register":
            assert block is not None
            if arg in model.refs:  # only blocks in use are registered
                new = arg not in model.index.values() and key(rest[0]) not in model.index
                assert pool.register(block, key(rest[0]), [rest[0]] * 2) == new
                if new:
                    model.index[key(rest[0])] = arg
        elif name in ("free", "free_many"):
            # free_many frees a block together with every block in use above it
            ids = [arg] if name == "free" else [arg] + [b for b in sorted(model.refs) if b > arg]
            if arg not in model.refs:
                with pytest.raises(ValueError, match="double free"):
                    pool.free([pool.blocks[b] for b in ids])
            else:
                pool.free([pool.blocks[b] for b in ids])
                for b in ids:
                    model.refs[b] -= 1
                    if model.refs[b] == 0:
                        model.release(b)
        else:  # reclaim
            assert block is not None
            pool.reclaim(block)
            if arg in model.refs:
                model.uncache(arg)
                model.refs[arg] = 1
                model.release(arg)
        check(pool, model)
