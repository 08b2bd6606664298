"""The ops' arguments written once (paged_ref/op_args.py): what ``@op`` makes
of an implementation, and how ``pass_to`` hands a call to another backend."""

from __future__ import annotations

import inspect

import pytest
import torch

from paged_ref import ops
from paged_ref.op_args import DecodeArgs, WriteKVArgs, op


def test_op_has_the_dataclass_parameters_and_the_implementation_doc():
    @op(WriteKVArgs)
    def write(a: WriteKVArgs) -> str:
        """Doc of the implementation."""
        return f"{a.slot_mapping} {a.k_scales}"

    params = list(inspect.signature(write).parameters)
    assert params == list(inspect.signature(WriteKVArgs).parameters)
    assert params[:5] == ["k_cache", "v_cache", "k", "v", "slot_mapping"]
    assert inspect.signature(write).return_annotation == "str"
    assert write.__name__ == "write" and write.__doc__ == "Doc of the implementation."
    assert write(1, 2, 3, 4, "slots", k_scales="ks") == "slots ks"
    with pytest.raises(TypeError, match="head_scale"):
        write(1, 2, 3, 4, 5, head_scale=1.0)  # a misspelt keyword is refused, not dropped


def test_pass_to_sends_only_the_keywords_that_are_set():
    """An ops module written before quantized caches (no scale keywords)
    still takes a 16-bit cache's call; a quantized call reaches it whole."""
    seen = {}

    def seed_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=None,
                    softcap=None, **kw):  # fmt: skip
        seen.update(positional=(q, seq_lens, scale, sliding_window, softcap), keywords=kw)
        return "out"

    assert DecodeArgs("q", "k", "v", "bt", "lens", 0.5).pass_to(seed_decode) == "out"
    assert seen == {"positional": ("q", "lens", 0.5, None, None), "keywords": {}}
    DecodeArgs("q", "k", "v", "bt", "lens", 0.5, 8, memo={}, k_scales="ks", v_scales="vs").pass_to(seed_decode)
    assert seen == {"positional": ("q", "lens", 0.5, 8, None), "keywords": {"memo": {}, "k_scales": "ks", "v_scales": "vs"}}


def test_the_reference_ops_take_their_documented_parameters():
    """docs/contracts.md's signature, by name and kind, on the public op."""
    sig = inspect.signature(ops.paged_decode_attention)
    positional = [p.name for p in sig.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    keywords = {p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY}
    assert positional == ["q", "k_cache", "v_cache", "block_tables", "seq_lens", "scale", "sliding_window", "softcap"]
    assert keywords == {"memo", "k_scales", "v_scales", "k_head_scales", "v_head_scales"}
    q = torch.zeros(0, 2, 8)
    cache = torch.zeros(1, 4, 2, 8)
    out = ops.paged_decode_attention(q, cache, cache, torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 1.0)
    assert out.shape == (0, 2, 8)
