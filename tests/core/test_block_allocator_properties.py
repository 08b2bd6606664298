"""Random allocate / share / take / free / force_free sequences against a model of the pool.

The model is a dict of reference counts plus the free ids in reuse order;
after every operation the allocator must agree with it exactly.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_core import BlockAllocator, OutOfBlocksError

TOTAL = 12
MIN_OPS = 40
EXAMPLES = 60  # >= 60 * 40 = 2,400 operations per run

op = st.one_of(
    st.tuples(st.just("allocate"), st.integers(0, 5)),
    st.tuples(st.just("share"), st.integers(0, TOTAL - 1)),
    st.tuples(st.just("take"), st.integers(0, TOTAL - 1)),
    st.tuples(st.just("free"), st.integers(0, TOTAL - 1)),
    st.tuples(st.just("free_many"), st.integers(0, TOTAL - 1)),
    st.tuples(st.just("force_free"), st.integers(0, TOTAL - 1)),
)


class PoolModel:
    """What the allocator should hold: ref counts and the free ids in reuse order."""

    def __init__(self, total: int) -> None:
        self.refs: dict[int, int] = {}
        self.free_order: OrderedDict[int, None] = OrderedDict.fromkeys(range(total))


def check(alloc: BlockAllocator, model: PoolModel) -> None:
    assert alloc.num_free() + alloc.num_allocated() == TOTAL
    assert alloc.num_free() == len(model.free_order)
    assert alloc.allocated_blocks() == sorted(model.refs)
    for b in range(TOTAL):
        assert alloc.ref_count(b) == model.refs.get(b, 0)
        assert alloc.is_free(b) == (b not in model.refs)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=MIN_OPS, max_size=80))
def test_random_operations_agree_with_model(ops):
    assert len(ops) >= MIN_OPS
    alloc = BlockAllocator(TOTAL)
    model = PoolModel(TOTAL)
    for name, arg in ops:
        if name == "allocate":
            if arg > len(model.free_order):
                with pytest.raises(OutOfBlocksError):
                    alloc.allocate(arg)
            else:
                expected = list(model.free_order)[:arg]
                got = alloc.allocate(arg)
                assert got == expected  # least recently freed first
                for b in got:
                    assert b not in model.refs, f"block {b} handed out twice"
                    model.refs[b] = 1
                    del model.free_order[b]
        elif name == "share":
            if arg in model.refs:
                alloc.share(arg)
                model.refs[arg] += 1
            else:
                with pytest.raises(ValueError, match="it is free"):
                    alloc.share(arg)
        elif name == "take":
            if arg in model.refs:
                with pytest.raises(ValueError, match="is not free"):
                    alloc.take(arg)
            else:
                alloc.take(arg)
                model.refs[arg] = 1
                del model.free_order[arg]
        elif name in ("free", "free_many"):
            # free_many frees a block together with every allocated block above it
            ids = [arg] if name == "free" else [arg] + [b for b in sorted(model.refs) if b > arg]
            if arg not in model.refs:
                with pytest.raises(ValueError, match="double free"):
                    alloc.free(ids)
            else:
                released = alloc.free(ids)
                expected = []
                for b in ids:
                    model.refs[b] -= 1
                    if model.refs[b] == 0:
                        del model.refs[b]
                        model.free_order[b] = None
                        expected.append(b)
                assert released == expected
        else:  # force_free
            alloc.force_free(arg)
            if arg in model.refs:
                del model.refs[arg]
                model.free_order[arg] = None
        check(alloc, model)
