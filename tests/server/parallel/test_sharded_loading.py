"""Each rank reads only its slices of the checkpoint, and the slices are the
right ones: the ranks' shards put back together are the whole model.

No processes here: a rank's shard is built and loaded with its
``TensorParallel`` place and no process group (loading needs none).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from paged_server.models import InvalidConfigError, load_model
from paged_server.models.tensor_parallel import TensorParallel, shard_heads

COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
KV = re.compile(r"\.(k_proj|v_proj)\.")
STACKED = re.compile(r"\.(qkv_proj|gate_up_proj)\.(weight|bias)$")  # the model's fused layers


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_each_rank_reads_only_its_slices(tp_checkpoints: dict[str, Path], family: str) -> None:
    path = tp_checkpoints[family]
    tensors = _checkpoint(path)
    full = load_model(path, torch.float32, "cpu")
    replicated_kv = full.config.num_kv_heads < 2  # Gemma's single KV head: every rank reads it
    expected = 0
    for key, t in tensors.items():
        sharded = (COLUMN.search(key) or ROW.search(key)) and not (replicated_kv and KV.search(key))
        if key == "lm_head.weight" and full.config.tie_word_embeddings:
            continue  # tied: not read at all
        expected += t.numel() * t.element_size() // (2 if sharded else 1)
    assert full.bytes_read == sum(
        t.numel() * t.element_size()
        for k, t in tensors.items()
        if not (k == "lm_head.weight" and full.config.tie_word_embeddings)
    )
    shards = [load_model(path, torch.float32, "cpu", TensorParallel(r, 2)) for r in range(2)]
    for shard in shards:
        assert shard.bytes_read == expected < full.bytes_read

    params = [dict(s.model.named_parameters()) for s in shards]
    layers = [dict(m.model.named_modules()) for m in [full, *shards]]
    for name, whole in full.model.named_parameters():
        parts = [p[name] for p in params]
        if STACKED.search(name):  # each stacked projection sharded on its own
            layer = name.rpartition(".")[0]
            sizes = [s.size for s in layers[0][layer].slices]
            for rank, part in enumerate(parts):
                mine = layers[1 + rank][layer].slices
                pieces = part.split([s.size for s in mine])
                for s, piece, whole_piece in zip(mine, pieces, whole.split(sizes), strict=True):
                    want = whole_piece[s.start : s.start + s.size]
                    torch.testing.assert_close(piece, want, rtol=0, atol=0)
        elif COLUMN.search(name) and not (replicated_kv and KV.search(name)):
            torch.testing.assert_close(torch.cat(parts, 0), whole, rtol=0, atol=0)
        elif ROW.search(name):
            torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=0, atol=0)
        else:  # replicated: embeddings, norms, LM head, row biases, replicated KV heads
            for part in parts:
                torch.testing.assert_close(part, whole, rtol=0, atol=0)


def test_head_split_and_replication() -> None:
    # 8 query heads, 4 KV heads over 2 ranks: split both.
    s = shard_heads(8, 4, TensorParallel(1, 2))
    assert (s.num_heads, s.num_kv_heads, s.q_start, s.kv_start) == (4, 2, 4, 2)
    # 8 query heads, 2 KV heads over 4 ranks: ranks 2 and 3 share KV head 1,
    # which their query heads (4-5, 6-7) use in the full model too.
    for rank, kv in enumerate([0, 0, 1, 1]):
        s = shard_heads(8, 2, TensorParallel(rank, 4))
        assert (s.num_heads, s.num_kv_heads, s.kv_start) == (2, 1, kv)
        assert s.q_start // (8 // 2) == kv


@pytest.mark.parametrize(
    ("heads", "kv_heads", "world", "message"),
    [
        (4, 2, 3, "num_attention_heads (4) is not divisible by tensor_parallel_size (3)"),
        (6, 3, 2, "num_key_value_heads (3) is not divisible by tensor_parallel_size (2)"),
        (12, 4, 6, "tensor_parallel_size (6) exceeds num_key_value_heads (4)"),
    ],
)
def test_uneven_splits_are_refused_clearly(heads: int, kv_heads: int, world: int, message: str) -> None:
    with pytest.raises(InvalidConfigError, match=re.escape(message)):
        shard_heads(heads, kv_heads, TensorParallel(0, world))
