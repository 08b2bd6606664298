"""The start-up warm-up's list, planned for a GPU on this machine: one
variant per kernel and distinct (window, soft-cap) pair, the split merge
only where a context can be long enough to split, nothing twice. (That the
list is exactly what an engine launches: tests/server/engine/test_kernel_warmup.py.)"""

from __future__ import annotations

import torch

from paged_triton.decode_splits import WAVES_PER_SM, SplitPolicy
from paged_triton.warmup import AttentionLayout, LayerAttention, kernel_variants, warm_up

H100 = SplitPolicy(target_programs=WAVES_PER_SM * 132)
CPU = torch.device("cpu")


def layout(max_model_len: int, *layers: LayerAttention, kv=torch.bfloat16) -> AttentionLayout:
    """Gemma 3 4B's heads (8 query, 4 kv, head_dim 256), bf16, blocks of 16."""
    return AttentionLayout(8, 4, 256, torch.bfloat16, kv, 16, 4096, max_model_len, layers)


def names(lo: AttentionLayout) -> list[str]:
    return [v.name for v in kernel_variants(lo, CPU, arch=90, policy=H100)]


def test_one_variant_per_kernel_and_layer_kind():
    local, global_ = LayerAttention(1024, 50.0), LayerAttention(None, 50.0)
    assert names(layout(8192, local, global_, local, local, global_)) == [
        "write_kv", "copy_blocks",
        "decode window softcap", "decode_merge window softcap", "prefill window softcap",
        "decode softcap", "decode_merge softcap", "prefill softcap",
    ]  # fmt: skip


def test_merge_only_where_a_context_can_split():
    """Decode splits contexts of 2 x 256 tokens or more (SplitPolicy.min_chunk):
    not at max_model_len 256, nor in a 256-token window."""
    assert "decode_merge" not in names(layout(256, LayerAttention()))
    assert names(layout(8192, LayerAttention(256), LayerAttention())) == [
        "write_kv", "copy_blocks", "decode window", "prefill window",
        "decode", "decode_merge", "prefill",
    ]  # fmt: skip


def test_window_sizes_share_variants():
    """The window size is a per-call integer the kernels do not specialise on."""
    lo = layout(8192, LayerAttention(512), LayerAttention(1024), LayerAttention(4096))
    assert names(lo) == ["write_kv", "copy_blocks", "decode window", "decode_merge window",
                         "prefill window"]  # fmt: skip


def test_int8_cache_copies_its_scales_too():
    lo = layout(256, LayerAttention(), kv=torch.int8)
    assert names(lo)[:3] == ["write_kv", "copy_blocks", "copy_blocks scales"]


def test_int4_cache_plans_its_write_kernel_and_scale_copies():
    """(V's scale copy is the same compiled variant as K's: one entry.)"""
    lo = layout(256, LayerAttention(), kv=torch.uint8)  # kv_cache_dtype int4
    variants = kernel_variants(lo, CPU, arch=90, policy=H100)
    assert [v.name for v in variants][:4] == ["write_kv", "copy_blocks", "copy_blocks scales", "decode"]
    assert variants[0].launch.kernel.__name__ == "_write_kv_int4_kernel"


def test_static_kv_scales_plan_the_head_scales_variants():
    """calculate_kv_scales: no per-token scales to copy, and write_kv /
    decode / prefill planned with the HEAD_SCALES constexpr the engine launches."""
    import dataclasses

    lo = dataclasses.replace(layout(256, LayerAttention(), kv=torch.int8), static_kv_scales=True)
    variants = kernel_variants(lo, CPU, arch=90, policy=H100)
    assert [v.name for v in variants] == ["write_kv", "copy_blocks", "decode", "prefill"]
    for v in variants:
        if v.name != "copy_blocks":
            assert v.launch.constexprs["HEAD_SCALES"] is True, v.name


def test_interpreter_lists_without_compiling():
    lo = layout(256, LayerAttention(None, 30.0))
    done = warm_up(lo, CPU)
    assert not done.compiled
    assert [v.name for v in done.variants] == ["write_kv", "copy_blocks", "decode softcap",
                                                "prefill softcap"]  # fmt: skip
