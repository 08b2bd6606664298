"""Property: for any small layout, page table and lengths hypothesis draws,
the Triton decode and prefill kernels agree with paged_ref.ops.

Few examples and small shapes: each one runs the kernels in the interpreter.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_ref import ops as ref_ops
from paged_triton.decode_splits import SplitPolicy
from paged_triton.ops import paged_prefill_attention

# Split policies small enough to cut these short contexts (16-token pieces).
POLICIES = [
    None,
    SplitPolicy(min_chunk=16, target_programs=1 << 20, max_splits=2),
    SplitPolicy(min_chunk=16, target_programs=1 << 20, max_splits=5),
    SplitPolicy(min_chunk=16, target_programs=24, max_splits=8),
]


@st.composite
def paged_batches(draw):
    """A layout, one (context, new queries) pair per sequence, and options."""
    kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    seqs = draw(
        st.lists(
            st.integers(0, 90).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))),
            min_size=1,
            max_size=3,
        )
    )
    return dict(
        heads=kv_heads * group,
        kv_heads=kv_heads,
        head_dim=draw(st.sampled_from([16, 24, 32])),
        block_size=draw(st.sampled_from([8, 16])),
        seqs=seqs,
        window=draw(st.none() | st.integers(1, 40)),
        softcap=draw(st.none() | st.floats(1.0, 10.0)),
        policy=draw(st.sampled_from(POLICIES)),
        share=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=paged_batches())
def test_kernels_match_reference(case, paged):
    gen = torch.Generator().manual_seed(case["seed"])
    dtype, block_size, head_dim = case["dtype"], case["block_size"], case["head_dim"]
    lens = [n for n, _ in case["seqs"]]
    num_blocks = paged.blocks_needed(lens, block_size)
    k_cache, v_cache = paged.random_caches(
        num_blocks, case["kv_heads"], block_size, head_dim, dtype, gen
    )
    tables = paged.random_block_tables(lens, block_size, num_blocks, gen, case["share"]).to(
        paged.device
    )
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=paged.device)
    scale, window, softcap = head_dim**-0.5, case["window"], case["softcap"]

    q = torch.randn(len(lens), case["heads"], head_dim, generator=gen).to(paged.device, dtype)
    out = paged.decode_attention(
        q, k_cache, v_cache, tables, seq_lens, scale, window, softcap, policy=case["policy"]
    )
    expected = ref_ops.paged_decode_attention(
        q, k_cache, v_cache, tables, seq_lens, scale, window, softcap
    )
    paged.assert_close(out, expected, dtype)

    q_lens = torch.tensor([q_len for _, q_len in case["seqs"]])
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = q_lens.cumsum(0)
    cu = cu.to(paged.device)
    q = torch.randn(int(cu[-1]), case["heads"], head_dim, generator=gen).to(paged.device, dtype)
    args = (q, k_cache, v_cache, tables, cu, seq_lens, scale, window, softcap)
    paged.assert_close(
        paged_prefill_attention(*args), ref_ops.paged_prefill_attention(*args), dtype
    )
