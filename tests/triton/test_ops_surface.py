"""paged_triton.ops is a drop-in for paged_ref.ops: same names, same signatures."""

from __future__ import annotations

import inspect

import pytest
import torch

import paged_triton
from paged_ref import ops as ref_ops
from paged_triton import ops

OP_NAMES = ["copy_blocks", "paged_decode_attention", "paged_prefill_attention", "write_kv"]


def test_exports_exactly_the_four_ops():
    assert sorted(ops.__all__) == OP_NAMES == sorted(ref_ops.__all__)


@pytest.mark.parametrize("name", OP_NAMES)
def test_signature_matches_reference(name):
    ours, theirs = inspect.signature(getattr(ops, name)), inspect.signature(getattr(ref_ops, name))
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == [
        (p.name, p.kind, p.default) for p in theirs.parameters.values()
    ]


def test_is_available_here():
    """The suite runs the kernels on CUDA or in the interpreter, so this must hold."""
    assert paged_triton.is_available()


def test_errors_say_what_is_wrong(gen, paged):
    k_cache, v_cache = paged.random_caches(4, 3, 8, 32, torch.float32, gen)
    q = torch.randn(1, 4, 32, device=paged.device)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=paged.device)
    lens = torch.ones(1, dtype=torch.int32, device=paged.device)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of kv heads \(3\)"):
        ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="must match"):
        ops.paged_decode_attention(q, k_cache, v_cache.half(), tables, lens, 1.0)
