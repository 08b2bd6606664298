"""LoRA adapters against PEFT: adapters made with ``peft`` on the tiny
transformers checkpoints, served by ``LoRAManager`` in one batch that mixes
rows of two adapters and of the base model, must give the logits of PEFT's
merged models (``merge_and_unload``), prompt chunks and decode rows alike.
Also: what is refused and why, the slot and host-memory LRUs, and tensor
parallel shards of A/B that add up to one rank's delta."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from paged_server.models import load_model
from paged_server.models.errors import LoRAAdapterError
from paged_server.models.linear import ColumnParallelLinear, RowParallelLinear
from paged_server.models.lora import (
    LoRAAdapterConfig,
    LoRAConfig,
    LoRAManager,
    LoRAMapping,
    SlotTable,
    read_adapter,
)
from paged_server.models.tensor_parallel import TensorParallel

LOGIT_ATOL = 1e-4  # float32, as the parity tests


@pytest.fixture(scope="module")
def adapters(lora_adapters):
    """family -> {adapter name: (directory, merged transformers model)} (conftest's)."""
    return lora_adapters


def lora_ops(backend: str):
    if backend == "triton":
        import paged_triton

        if not paged_triton.is_available():
            pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
        from paged_triton import lora_ops as ops

        return ops
    from paged_ref import lora_ops as ops

    return ops


@torch.no_grad()
def mixed_batch_against_peft(checkpoint, adapters, pool_of, prompt_of, ops):
    """Three prompts (adapter, base, the other adapter) prefilled in one flat
    batch, then two decode steps of all three: each row's logits equal
    transformers + PEFT's merged model of its adapter (the base model's for
    the base row)."""
    loaded = load_model(checkpoint.path)  # fresh: the manager attaches tables to it
    manager = LoRAManager(loaded.model, LoRAConfig(max_loras=2, max_lora_rank=8), ops)
    for name, (path, _) in adapters.items():
        manager.add(name, path)
    names = ["patterns", None, "rslora"]
    oracles = [adapters["patterns"][1], checkpoint.hf_model, adapters["rslora"][1]]
    prompts = [prompt_of(n, 40 + i) for i, n in enumerate((9, 6, 12))]
    pool = pool_of("paged", loaded)
    seq_ids = [pool.allocate_sequence(p)[0] for p in prompts]
    lens = [len(p) for p in prompts]
    view = pool.batched_prefill_view(seq_ids, lens)
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for n in lens for i in range(n)])
    logits = loaded.model(ids, positions, view, lora=manager.mapping(lens, names))
    view.advance(len(ids))
    seqs = [list(p) for p in prompts]
    for i, rows in enumerate(logits.split(lens)):
        want = oracles[i](torch.tensor([seqs[i]])).logits[0]
        torch.testing.assert_close(rows, want, atol=LOGIT_ATOL, rtol=0)
    base = checkpoint.hf_model(torch.tensor([seqs[0]])).logits[0]
    assert (logits.split(lens)[0] - base).abs().max() > 0.05  # the adapter changed them
    last = torch.stack([rows[-1] for rows in logits.split(lens)])
    for _ in range(2):
        tokens = last.argmax(-1).tolist()
        for seq_id, seq, token in zip(seq_ids, seqs, tokens, strict=True):
            pool.append_token(seq_id, token)
            seq.append(token)
        view = pool.decode_view(seq_ids)
        mapping = manager.mapping([1, 1, 1], names)
        assert mapping.decode_rows == 3  # the BGMV path
        positions = torch.tensor([len(s) - 1 for s in seqs])
        last = loaded.model(torch.tensor(tokens), positions, view, lora=mapping)
        view.advance(3)
        for i, seq in enumerate(seqs):
            want = oracles[i](torch.tensor([seq])).logits[0, -1]
            torch.testing.assert_close(last[i], want, atol=LOGIT_ATOL, rtol=0)
    assert pool.audit() == []


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_mixed_batch_equals_peft_merged_models(checkpoints, adapters, family, pool_of, prompt_of):
    mixed_batch_against_peft(
        checkpoints[family], adapters[family], pool_of, prompt_of, lora_ops("ref")
    )


@pytest.mark.backend
def test_mixed_batch_on_backend_equals_peft(
    checkpoints, adapters, attention_backend, pool_of, prompt_of
):
    """The same batch with the backend's LoRA ops (Triton: SGMV for the
    prompts, BGMV for the decode rows)."""
    mixed_batch_against_peft(
        checkpoints["llama"], adapters["llama"], pool_of, prompt_of, lora_ops(attention_backend)
    )


@torch.no_grad()
def test_no_adapter_leaves_the_forward_unchanged(checkpoints, adapters, prompt_of):
    """Tables attached, adapters loaded: a step with no adapter row gets no
    mapping, and its logits are bit-identical to the model without tables."""
    loaded = load_model(checkpoints["llama"].path)
    ids = torch.tensor([prompt_of(7, 3)])
    positions = torch.arange(7)[None]
    before = loaded.model(ids, positions)
    no_tables = loaded.model(ids, positions, lora=LoRAMapping.build([7], [0]))
    assert torch.equal(no_tables, before)  # a mapping without tables changes nothing
    manager = LoRAManager(loaded.model, LoRAConfig(max_loras=1, max_lora_rank=8))
    manager.add("patterns", adapters["llama"]["patterns"][0])
    assert manager.mapping([7], [None]) is None
    assert torch.equal(loaded.model(ids, positions), before)
    mapping = manager.mapping([7], ["patterns"])
    assert not torch.equal(loaded.model(ids, positions, lora=mapping), before)


@torch.no_grad()
def test_slots_and_host_memory_are_lrus(checkpoints, adapters, prompt_of):
    """One device slot and one adapter in host memory, two adapters taking
    turns: each step gets its own adapter's logits (the slot rewritten, the
    adapter read from disk again after eviction)."""
    loaded = load_model(checkpoints["llama"].path)
    manager = LoRAManager(loaded.model, LoRAConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=1))
    for name, (path, _) in adapters["llama"].items():
        manager.add(name, path)
    assert list(manager._host) == ["rslora"]  # "patterns" left host memory
    ids = prompt_of(5, 9)
    for name in ["patterns", "rslora", "patterns", "rslora"]:
        mapping = manager.mapping([5], [name])
        assert manager.slot_of(name) == 0 and manager.slots.names == [name]
        got = loaded.model(torch.tensor([ids]), torch.arange(5)[None], lora=mapping)[0]
        want = adapters["llama"][name][1](torch.tensor([ids])).logits[0]
        torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0)
    with pytest.raises(ValueError, match="max_loras is 1"):
        manager.mapping([5, 5], ["patterns", "rslora"])
    manager.remove("rslora")
    assert manager.slot_of("rslora") == -1 and manager.names == ["patterns"]
    assert all(t.lora_b.abs().sum() == 0 for t in manager.tables.values())  # the slot zeroed


def test_slot_table_evicts_the_least_recently_used():
    table = SlotTable(2)
    assert table.assign(["a", "b"]) == [(0, "a"), (1, "b")]
    assert table.assign(["a"]) == []  # a is now the most recent
    assert table.assign(["c"]) == [(1, "c")]  # b goes
    assert table.assign(["c", "b"]) == [(0, "b")]  # a goes, c stays: the step uses it
    assert table.free("c") == 1 and table.slot_of("c") == -1
    assert table.assign(["d"]) == [(1, "d")]


@torch.no_grad()
def test_tensor_parallel_shards_give_one_ranks_delta(checkpoints, adapters):
    """Each rank's A/B slices, applied to its shard's input, give its share
    of the one-rank delta: column-parallel q/k/v and gate/up its output
    columns of each stacked projection, row-parallel o and down a partial
    delta that the all-reduce sums (here: summed by hand)."""

    class NoComm:  # the partial sum is what the test reads
        def all_reduce(self, tensor):
            pass

    path = checkpoints["llama"].path
    adapter = adapters["llama"]["patterns"][0]
    models = [load_model(path).model] + [
        load_model(path, tp=TensorParallel(r, 2, NoComm())).model for r in range(2)
    ]
    for model in models:
        manager = LoRAManager(model, LoRAConfig(max_loras=1, max_lora_rank=8))
        manager.add("a", adapter)
        assert manager.activate(["a"]) == [0]
    mapping = LoRAMapping.build([3, 2], [0, -1])  # three adapter rows, two base rows
    gen = torch.Generator().manual_seed(0)
    whole, *ranks = (dict(m.named_modules()) for m in models)
    for name, layer in whole.items():
        if not isinstance(layer, ColumnParallelLinear | RowParallelLinear):
            continue
        x = torch.randn(5, layer.in_features, generator=gen)
        delta = layer(x, mapping) - layer(x)
        assert delta[:3].abs().max() > 1e-3 and delta[3:].abs().max() == 0
        shards = [r[name] for r in ranks]
        if isinstance(layer, ColumnParallelLinear):
            got = [s.split(s(x, mapping) - s(x)) for s in shards]
            want = layer.split(delta)
            for i, part in enumerate(want):  # each projection: rank 0's columns, then rank 1's
                torch.testing.assert_close(torch.cat([g[i] for g in got], -1), part, atol=1e-5, rtol=0)
        else:
            pieces = x.chunk(2, dim=-1)
            got = sum(s(p, mapping) - s(p) for s, p in zip(shards, pieces, strict=True))
            torch.testing.assert_close(got, delta, atol=1e-5, rtol=0)


def _copy_adapter(src: Path, dst: Path, edit_config=None, edit_tensors=None) -> Path:
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    tensors = load_file(src / "adapter_model.safetensors")
    if edit_config:
        edit_config(config)
    if edit_tensors:
        edit_tensors(tensors)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, dst / "adapter_model.safetensors")
    return dst


def _set(**fields):
    return lambda config: config.update(fields)


def _add_tensor(key, shape):
    return lambda tensors: tensors.update({key: torch.zeros(shape)})


@pytest.mark.parametrize(
    "config_edit,tensor_edit,message",
    [
        (_set(use_dora=True), None, "DoRA"),
        (_set(modules_to_save=["lm_head"]), None, "modules_to_save"),
        (_set(bias="all"), None, "bias='none'"),
        (_set(peft_type="IA3"), None, "IA3 adapter"),
        (_set(target_modules=["q_proj", "lm_head"]), None, "LM head"),
        (None, _add_tensor("base_model.model.model.embed_tokens.lora_embedding_A", (8, 512)), "embeddings"),
        (None, _add_tensor("base_model.model.lm_head.lora_A.weight", (8, 64)), "LM head"),
        (None, _add_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", (64,)), "DoRA"),
        (_set(target_modules=["q_proj", "c_attn"]), None, "c_attn"),
        (None, lambda t: t.update({
            "base_model.model.model.layers.0.mlp.experts.0.w1.lora_A.weight": torch.zeros(8, 64),
            "base_model.model.model.layers.0.mlp.experts.0.w1.lora_B.weight": torch.zeros(128, 8)}),
         "not a LoRA-capable projection"),
        (None, lambda t: t.pop("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"), "no lora_B"),
    ],
    ids=["dora", "modules_to_save", "bias", "ia3", "lm_head-target", "embedding-tensor",
         "lm_head-tensor", "dora-tensor", "missing-target", "expert-tensor", "half-pair"],
)  # fmt: skip
def test_unsupported_adapters_are_refused_naming_why(
    checkpoints, adapters, tmp_path, config_edit, tensor_edit, message
):
    src = adapters["llama"]["patterns"][0]
    path = _copy_adapter(src, tmp_path / "edited", config_edit, tensor_edit)
    manager = LoRAManager(load_model(checkpoints["llama"].path).model, LoRAConfig(max_lora_rank=8))
    with pytest.raises(LoRAAdapterError, match=message) as err:
        manager.add("edited", path)
    assert "\n" not in str(err.value)
    assert manager.names == []


def test_rank_above_max_lora_rank_is_refused(checkpoints, adapters):
    manager = LoRAManager(load_model(checkpoints["llama"].path).model, LoRAConfig(max_lora_rank=4))
    with pytest.raises(LoRAAdapterError, match="rank 8 .* max_lora_rank is 4; .*--max-lora-rank 8"):
        manager.add("big", adapters["llama"]["patterns"][0])
    manager.add("small", adapters["llama"]["rslora"][0])  # rank 4 fits


def test_an_adapter_of_another_model_is_refused(checkpoints, adapters):
    """Qwen 3's adapter (head_dim 32: wider q/k/v) on the Llama model."""
    manager = LoRAManager(load_model(checkpoints["llama"].path).model, LoRAConfig(max_lora_rank=8))
    with pytest.raises(LoRAAdapterError, match="trained for another model"):
        manager.add("qwen", adapters["qwen3"]["patterns"][0])


def test_peft_config_fields_are_read_as_peft_does(adapters):
    adapter = read_adapter("p", adapters["llama"]["patterns"][0])
    config = adapter.config
    assert (config.r, config.lora_alpha, config.use_rslora) == (8, 16.0, False)
    assert config.scaling("model.layers.1.self_attn.q_proj") == 16 / 8
    assert config.scaling("model.layers.1.self_attn.v_proj") == 16 / 4  # rank_pattern
    assert config.scaling("model.layers.1.mlp.down_proj") == 4 / 8  # alpha_pattern
    assert adapter.weights["model.layers.1.self_attn.v_proj"][0].shape[0] == 4
    rs = read_adapter("r", adapters["llama"]["rslora"][0]).config
    assert rs.use_rslora and rs.scaling("model.layers.0.self_attn.q_proj") == 8 / 2  # alpha / sqrt(r)
    bare = LoRAAdapterConfig.from_dict({"target_modules": ["q_proj"]}, "bare")
    assert (bare.r, bare.lora_alpha) == (8, 8.0)  # LoraConfig's defaults when the file omits them


@torch.no_grad()
def test_stacked_checkpoint_projections_equal_peft(checkpoints, tmp_path, prompt_of, make_lora_adapter):
    """Phi-3 stores q/k/v and gate/up stacked, so PEFT adapts qkv_proj and
    gate_up_proj as one projection each: one A shared by the stacked
    projections, B cut along their rows."""
    checkpoint = checkpoints["phi3"]
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    merged = make_lora_adapter(checkpoint.hf_model, tmp_path / "phi3", 5, r=8, lora_alpha=8, target_modules=targets)
    loaded = load_model(checkpoint.path)
    manager = LoRAManager(loaded.model, LoRAConfig(max_loras=1, max_lora_rank=16))
    manager.add("phi", tmp_path / "phi3")
    ids = torch.tensor([prompt_of(11, 6), prompt_of(11, 7)])
    got = loaded.model(ids, torch.arange(11).expand(2, -1), lora=manager.mapping([11, 11], ["phi", None]))
    torch.testing.assert_close(got[0], merged(ids[:1]).logits[0], atol=LOGIT_ATOL, rtol=0)
    torch.testing.assert_close(got[1], checkpoint.hf_model(ids[1:]).logits[0], atol=LOGIT_ATOL, rtol=0)
