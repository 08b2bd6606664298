"""Gemma 3 with a hybrid KV cache (sliding layers in their own KV cache
groups, giving blocks back as they leave the window) generates exactly what
transformers does, through chunked prefill, prefix hits and preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from paged_server import LLM, SamplingParams
from paged_server.models import load_model

WINDOW, BLOCK = 8, 4
STEPS = 40  # five windows past the prompt
# 4 sliding + 2 global layers: groups of 2 layers (1 full group, 2 sliding).
LAYER_TYPES = (
    ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]
)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, tokenizer_json):
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
        layer_types=LAYER_TYPES, max_position_embeddings=256, initializer_range=0.1,
        query_pre_attn_scalar=24, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    hf = Gemma3ForCausalLM._from_config(config, attn_implementation="eager").eval()
    path = tmp_path_factory.mktemp("gemma3-hybrid")
    hf.save_pretrained(path)
    (path / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    return hf, load_model(path)


def make_llm(loaded, backend: str, **kw) -> LLM:
    cfg = dict(
        max_batch_size=3, max_model_len=96, block_size=BLOCK, max_num_batched_tokens=12,
        device="cpu", attention_backend=backend,
    )  # fmt: skip
    cfg.update(kw)
    return LLM(loaded=loaded, **cfg)


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    results = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert llm.engine.audit() == []
    return [r.outputs[0].token_ids for r in results]


@pytest.mark.backend
def test_greedy_matches_transformers_with_chunks_hits_and_preemption(
    gemma3, attention_backend, prompt_of, hf_greedy_of
):
    hf, loaded = gemma3
    prompts = [prompt_of(9, 1), prompt_of(10, 2), prompt_of(30, 3)]
    expected = [hf_greedy_of(hf, p, STEPS) for p in prompts]
    # 3 groups, 26 usable blocks: a sequence of 9 + 40 tokens peaks at 13
    # blocks in the full group and 3 in each sliding one, so two running
    # together outgrow the pool and one is preempted.
    llm = make_llm(loaded, attention_backend, num_gpu_blocks=27)
    assert llm.engine.capacity.num_groups == 3
    assert run(llm, prompts) == expected  # chunked prefill (12-token steps), preemptions
    assert llm.engine.metrics()["num_preemptions_total"] > 0
    # A pool large enough to keep what was computed: the prompt again hits
    # the prefix cache (the global group's blocks and the sliding groups' window).
    roomy = make_llm(loaded, attention_backend, num_gpu_blocks=120)
    assert run(roomy, prompts[2:]) == expected[2:]
    assert run(roomy, prompts[2:]) == expected[2:]
    assert roomy.engine.metrics()["prefix_cache_hits_total"] == 28


def test_hybrid_and_one_group_agree_and_hybrid_holds_fewer_blocks(gemma3, prompt_of):
    _, loaded = gemma3
    prompts = [prompt_of(25, 4), prompt_of(13, 5)]
    hybrid = make_llm(loaded, "ref", num_gpu_blocks=200)
    one = make_llm(loaded, "ref", num_gpu_blocks=200, disable_hybrid_kv_cache_manager=True)
    assert one.engine.capacity.num_groups == 1
    assert run(hybrid, prompts) == run(one, prompts)
    # One sequence of 25 + 40 tokens, in layer-blocks (block bytes differ by group size):
    # one group holds 6 layers x 17 blocks; hybrid 2 x 17 + 4 x (<= 3).
    for llm, bound in ((hybrid, 2 * 17 + 4 * 3), (one, 6 * 17)):
        engine = llm.engine
        engine.add_request(
            "long", prompts[0], SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
        )
        layers_per_block = 6 // engine.capacity.num_groups
        peak = 0
        while engine.has_unfinished():
            engine.step()
            used = engine.capacity.num_blocks - engine.kv_manager.free_seq_count()
            peak = max(peak, used * layers_per_block)
        assert (
            peak <= bound + layers_per_block * engine.capacity.num_groups
        )  # one block reserved ahead
        assert peak >= bound - layers_per_block * engine.capacity.num_groups


def test_padded_decode_graph_buffers_carry_every_groups_tables(gemma3, prompt_of):
    """The CUDA-graph static path (run eagerly on the CPU) with per-group page
    tables and slot mappings gives the plain path's tokens on a hybrid pool."""
    from paged_server.engine.worker.decode_graphs import DecodeGraphs

    _, loaded = gemma3
    prompts = [prompt_of(5 + 6 * i, 10 + i) for i in range(3)]
    plain = run(make_llm(loaded, "ref", num_gpu_blocks=200), prompts)
    llm = make_llm(loaded, "ref", num_gpu_blocks=200)
    engine, config = llm.engine, llm.engine.config
    graphs = DecodeGraphs(
        loaded.model, engine.worker.tensors, torch.device("cpu"), config.max_batch_size,
        -(-config.max_model_len // config.block_size), capture=False,
        num_groups=engine.capacity.num_groups,
    )  # fmt: skip
    engine.worker.graphs = graphs
    assert len(graphs.block_tables) == 3
    assert run(llm, prompts) == plain


def test_calculated_kv_scales_follow_layers_not_cache_layers(gemma3, prompt_of):
    """Static scales are kept per layer while a hybrid pool's tensors hold
    cache layers: int8 with calculated scales gives the same tokens with and
    without KV cache groups."""
    _, loaded = gemma3
    prompts = [prompt_of(21, 6), prompt_of(11, 7)]
    kw = dict(num_gpu_blocks=200, kv_cache_dtype="int8", calculate_kv_scales=True)
    hybrid = make_llm(loaded, "ref", **kw)
    one = make_llm(loaded, "ref", disable_hybrid_kv_cache_manager=True, **kw)
    assert hybrid.engine.capacity.num_groups == 3
    assert hybrid.engine.worker.tensors.k_head_scales.shape[0] == 6  # type: ignore[attr-defined]
    assert run(hybrid, prompts) == run(one, prompts)


def test_prometheus_reports_each_groups_blocks(gemma3, prompt_of):
    """/metrics exports the blocks each KV cache group holds, read from the
    engine's snapshot: they add up to the pool's blocks in use, and the
    sliding groups hold fewer than the global one on a long sequence."""
    from prometheus_client.parser import text_string_to_metric_families

    from paged_server.entrypoints.openai.metrics import ServerMetrics

    _, loaded = gemma3
    engine = make_llm(loaded, "ref", num_gpu_blocks=200).engine
    engine.add_request(
        "long", prompt_of(30, 8), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    )
    for _ in range(12):
        engine.step()
    metrics = ServerMetrics("gemma")
    metrics.read_engine_from(engine.metrics)
    fams = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    used = {s.labels["group"]: s.value for s in fams["paged:kv_cache_group_blocks_used"].samples}
    assert set(used) == {"0", "1", "2"}
    assert sum(used.values()) == engine.capacity.num_blocks - engine.kv_manager.free_seq_count()
    assert used["1"] < used["0"] and used["2"] < used["0"]  # group 0 is the full one
