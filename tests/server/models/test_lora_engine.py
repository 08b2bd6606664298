"""LoRA adapters through the engine (``--enable-lora``): greedy tokens of
each adapter equal transformers + PEFT's merged model (fp32), in a batch
that mixes adapters and the base model as each request alone; the prefix
cache never serves one adapter's KV to another; ``max_loras`` adapters per
step, the others waiting, never failing; an adapter unloaded while its
requests run lets them finish with its own weights."""

from __future__ import annotations

import pytest
import torch

from paged_server import LLM, LoRARequest, SamplingParams
from paged_server.engine.worker.compiled_forward import compiled_graphs

MAX_TOKENS = 8
ENGINE = dict(
    device="cpu", dtype="float32", attention_backend="ref", max_model_len=128, block_size=16,
    max_batch_size=8, max_num_batched_tokens=256, enable_lora=True, max_lora_rank=8,
)  # fmt: skip


@torch.no_grad()
def hf_greedy(model, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens (the oracle)."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS
    )
    return out[0, len(prompt):].tolist()


def loras_of(adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i, str(path)) for i, (name, (path, _)) in enumerate(adapters.items(), 1)}


def greedy(llm: LLM, prompts, loras):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    results = llm.generate(prompt_token_ids=prompts, sampling_params=params, lora_request=loras)
    return [r.outputs[0].token_ids for r in results], [r.num_cached_tokens for r in results]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_mixed_batch_equals_peft_and_each_alone(checkpoints, lora_adapters, prompt_of, family):
    checkpoint, adapters = checkpoints[family], lora_adapters[family]
    loras = loras_of(adapters)
    names = ["patterns", None, "rslora", "patterns", None]
    prompts = [prompt_of(9 + 5 * i, i) for i in range(len(names))]
    oracles = {None: checkpoint.hf_model} | {n: merged for n, (_, merged) in adapters.items()}
    want = [hf_greedy(oracles[n], p) for n, p in zip(names, prompts, strict=True)]
    llm = LLM(str(checkpoint.path), max_loras=2, **ENGINE)
    batch, _ = greedy(llm, prompts, [loras.get(n) for n in names])
    assert batch == want
    # a small token budget: prompt chunks of one adapter beside decodes of others in each step
    chunked = LLM(str(checkpoint.path), max_loras=2, **{**ENGINE, "max_num_batched_tokens": 16})
    assert greedy(chunked, prompts[::-1], [loras.get(n) for n in names[::-1]])[0] == want[::-1]
    for name, prompt, tokens in zip(names, prompts, want, strict=True):
        assert greedy(llm, [prompt], loras.get(name))[0] == [tokens]
    base = [hf_greedy(checkpoint.hf_model, p) for p in prompts]
    assert all(w != b for w, b, n in zip(want, base, names, strict=True) if n)  # the adapters matter
    assert llm.engine.audit() == []


def test_prefix_cache_never_crosses_adapters(checkpoints, lora_adapters, prompt_of):
    """One 40-token prompt (two full blocks to share) under each adapter and
    the base model in turn: only the same adapter's second request is served
    from the cache, and every answer is its own model's."""
    checkpoint, adapters = checkpoints["llama"], lora_adapters["llama"]
    loras = loras_of(adapters)
    prompt = prompt_of(40, 3)
    llm = LLM(str(checkpoint.path), max_loras=2, **ENGINE)
    order = ["patterns", "rslora", None, "patterns", None, "rslora"]
    got = [greedy(llm, [prompt], loras.get(n)) for n in order]
    assert [cached[0] for _, cached in got] == [0, 0, 0, 32, 32, 32]
    oracles = {None: checkpoint.hf_model} | {n: merged for n, (_, merged) in adapters.items()}
    for name, (tokens, _) in zip(order, got, strict=True):
        assert tokens == [hf_greedy(oracles[name], prompt)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_slot_two_adapters_all_complete(checkpoints, lora_adapters, prompt_of, async_scheduling):
    """``max_loras=1``: requests of two adapters submitted together each
    wait for the other adapter's to finish, and all get their own tokens
    (also with the next step planned while one runs)."""
    checkpoint, adapters = checkpoints["llama"], lora_adapters["llama"]
    loras = loras_of(adapters)
    names = ["patterns", "rslora", "patterns", None, "rslora"]
    prompts = [prompt_of(7 + i, 10 + i) for i in range(len(names))]
    llm = LLM(str(checkpoint.path), max_loras=1, max_cpu_loras=1, async_scheduling=async_scheduling, **ENGINE)
    engine = llm.engine
    for i, (name, prompt) in enumerate(zip(names, prompts, strict=True)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                           ignore_eos=True), lora_request=loras.get(name))  # fmt: skip
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(names))}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
            tokens[out.request_id] += out.new_token_ids
        running = {s.request.lora_name for s in engine.scheduler.running} - {None}
        assert len(running) <= 1  # one slot: one adapter's requests run at a time
    oracles = {None: checkpoint.hf_model} | {n: merged for n, (_, merged) in adapters.items()}
    for i, (name, prompt) in enumerate(zip(names, prompts, strict=True)):
        assert tokens[f"r{i}"] == hf_greedy(oracles[name], prompt)


def test_unload_with_requests_in_flight_lets_them_finish(checkpoints, lora_adapters, prompt_of):
    """An adapter unloaded after its request's first step: the request ends
    with the adapter's tokens, a new request for it is refused, and the
    workers drop its weights once the request is done."""
    checkpoint, adapters = checkpoints["llama"], lora_adapters["llama"]
    lora = loras_of(adapters)["patterns"]
    prompt = prompt_of(12, 4)
    llm = LLM(str(checkpoint.path), **ENGINE)
    engine = llm.engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine.add_request("a", prompt, params, lora_request=lora)
    tokens = [t for out in engine.step() for t in out.new_token_ids]
    assert engine.remove_lora("patterns") and engine.lora_requests == {}
    with pytest.raises(ValueError, match="being unloaded"):
        engine.add_request("b", prompt, params, lora_request=lora)
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == hf_greedy(adapters["patterns"][1], prompt)
    assert engine.worker.lora.names == ["patterns"]  # dropped by the next step's commands
    engine.add_request("c", prompt, params)
    while engine.has_unfinished():
        engine.step()
    assert engine.worker.lora.names == []
    assert engine.remove_lora("patterns") is False


def test_lora_needs_enable_lora(checkpoints, lora_adapters, prompt_of):
    llm = LLM(str(checkpoints["llama"].path), **{**ENGINE, "enable_lora": False})
    lora = loras_of(lora_adapters["llama"])["patterns"]
    [result] = llm.generate(prompt_token_ids=[prompt_of(5, 1)], lora_request=lora)
    assert "--enable-lora" in result.outputs[0].error


@pytest.mark.parametrize("path", [pytest.param("compiled", marks=pytest.mark.slow), "graphs"])  # compiling: ~30 s
def test_compiled_forward_and_decode_graphs_with_adapters(
    checkpoints, lora_adapters, prompt_of, monkeypatch, path
):
    """With the compiled CPU forward, steps with adapters run graphs of
    their own (compiled at warm-up: serving compiles nothing); with the
    decode graphs' static path they run eagerly. The tokens are PEFT's."""
    if path == "compiled":
        monkeypatch.setenv("PAGED_COMPILE", "1")
    else:
        monkeypatch.setenv("PAGED_DECODE_GRAPHS", "eager")
    checkpoint, adapters = checkpoints["llama"], lora_adapters["llama"]
    loras = loras_of(adapters)
    llm = LLM(str(checkpoint.path), max_loras=2, **ENGINE)
    worker = llm.engine.worker
    assert (worker.compiled if path == "compiled" else worker.graphs) is not None
    names = [None, "rslora", "patterns", None]
    prompts = [prompt_of(6 + 4 * i, 20 + i) for i in range(len(names))]
    oracles = {None: checkpoint.hf_model} | {n: merged for n, (_, merged) in adapters.items()}
    graphs = compiled_graphs()
    got, _ = greedy(llm, prompts, [loras.get(n) for n in names])
    assert compiled_graphs() == graphs, "serving compiled a new graph"
    assert got == [hf_greedy(oracles[n], p) for n, p in zip(names, prompts, strict=True)]
    assert greedy(llm, prompts[:1], None)[0] == got[:1]  # the adapter-free steps, compiled or replayed


def test_speculative_decoding_with_adapters(checkpoints, lora_adapters, prompt_of):
    """Prompt lookup's verify steps (a decoding sequence's drafts computed
    in one pass) carry each sequence's adapter: greedy tokens stay PEFT's."""
    checkpoint, adapters = checkpoints["llama"], lora_adapters["llama"]
    loras = loras_of(adapters)
    names = ["patterns", None, "rslora"]
    prompts = [prompt_of(5, 30 + i) * 4 for i in range(len(names))]  # repeats: drafts to verify
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    llm = LLM(str(checkpoint.path), max_loras=2, speculative_config=spec, **ENGINE)
    oracles = {None: checkpoint.hf_model} | {n: merged for n, (_, merged) in adapters.items()}
    got, _ = greedy(llm, prompts, [loras.get(n) for n in names])
    assert got == [hf_greedy(oracles[n], p) for n, p in zip(names, prompts, strict=True)]
    assert llm.engine.metrics().get("spec_decode_num_draft_tokens_total", 0) > 0


def test_loading_an_adapter_while_streams_run(checkpoints, lora_adapters, prompt_of):
    """An adapter loaded (and then used) while eight streams decode: no
    request fails, and every stream keeps its own model's tokens."""
    checkpoint, adapters = checkpoints["llama"], lora_adapters["llama"]
    loras = loras_of(adapters)
    llm = LLM(str(checkpoint.path), max_loras=2, **ENGINE)
    engine = llm.engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    names: dict[str, str | None] = {f"r{i}": ("patterns" if i % 2 else None) for i in range(8)}
    prompts = {rid: prompt_of(6 + i, 40 + i) for i, rid in enumerate(names)}
    for rid, name in names.items():
        engine.add_request(rid, prompts[rid], params, lora_request=loras.get(name))
    tokens: dict[str, list[int]] = {rid: [] for rid in names}
    for step in range(MAX_TOKENS + 20):
        if step == 2:
            assert engine.add_lora(loras["rslora"])
            names["late"], prompts["late"], tokens["late"] = "rslora", prompt_of(9, 50), []
            engine.add_request("late", prompts["late"], params, lora_request=loras["rslora"])
        for out in engine.step():
            assert out.error is None
            tokens[out.request_id] += out.new_token_ids
        if step > 2 and not engine.has_unfinished():
            break
    oracles = {None: checkpoint.hf_model} | {n: merged for n, (_, merged) in adapters.items()}
    assert tokens == {rid: hf_greedy(oracles[name], prompts[rid]) for rid, name in names.items()}
