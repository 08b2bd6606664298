"""The compiled forward pass (torch.compile, attention as the opaque custom
op ``paged::attention``) gives the eager pass's tokens and logprobs on both
pools and on the hybrid sliding-window model, compiles everything at
warm-up (serving adds no graph), and ``enforce_eager`` turns it off.

Compiling costs seconds per engine, so these are the only engines in the
suite built with ``PAGED_COMPILE`` on."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch._dynamo.utils import counters

from paged_server.config import EngineConfig
from paged_server.engine.core.llm_engine import LLMEngine
from paged_server.engine.worker.compiled_forward import (
    GRAPHS_PER_ENGINE,
    ROW_BUCKET,
    CompiledForward,
    _gemm_template_options,
    _step,
    attention_op,
    compiled_graphs,
    compiles_forward,
    padded_rows,
    row_buckets,
)
from paged_server.models import few_row_gemm, load_model
from paged_server.models.llama import LlamaForCausalLM
from paged_server.models.mixtral import MixtralForCausalLM
from paged_server.models.quantization import QuantizedLinear
from paged_server.models.quantization.linear import PACKED_CPU_KERNELS
from paged_server.models.quantization.weights import quantize_int
from paged_server.models.qwen3_moe import Qwen3MoeForCausalLM


@pytest.fixture
def compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGED_COMPILE", "1")


def mixed_workload(prompt_of, greedy):
    """Decodes, long prefills split into chunks, a shared prefix and prompt
    logprobs: steps of one token and of many."""
    shared = prompt_of(12, 7)
    requests = [
        (f"r{i}", (shared if i % 2 else []) + prompt_of(2 + 9 * i, i), greedy(8, logprobs=0))
        for i in range(5)
    ]
    requests.append(("scored", prompt_of(6, 99), greedy(3, logprobs=0, prompt_logprobs=0)))
    requests.append(("alone", prompt_of(1, 5), greedy(6, logprobs=0)))
    return requests


def assert_same(run, reference, requests) -> None:
    for request_id, _, _ in requests:
        got, want = run.choices[(request_id, 0)], reference.choices[(request_id, 0)]
        assert got.error is None, got.error
        assert got.token_ids == want.token_ids, request_id
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4), request_id


def test_a_step_that_samples_nothing_compiles_nothing(
    compiling, make_engine, run_engine, prompt_of, greedy
) -> None:
    """A long prompt alone, in chunks: the steps before its last chunk sample
    no row, and must not compile a 0-row LM-head graph while serving."""
    engine = make_engine(max_batch_size=2, max_num_batched_tokens=16)
    after_warm_up = compiled_graphs()
    run = run_engine(engine, [("long", prompt_of(40, 3), greedy(2))])
    assert compiled_graphs() == after_warm_up, "serving compiled a new graph"
    assert run.choices[("long", 0)].error is None


@pytest.mark.parametrize("pool", ["paged", "contiguous"])
def test_compiled_matches_eager_and_never_recompiles(
    compiling, make_engine, run_engine, prompt_of, greedy, pool
) -> None:
    requests = mixed_workload(prompt_of, greedy)
    settings = dict(kv_cache_backend=pool, max_batch_size=4, max_num_batched_tokens=16)
    eager = run_engine(make_engine(enforce_eager=True, **settings), requests)
    engine = make_engine(**settings)
    assert engine.worker.compiled is not None
    after_warm_up = compiled_graphs()
    run = run_engine(engine, requests)
    assert compiled_graphs() == after_warm_up, "serving compiled a new graph"
    assert_same(run, eager, requests)
    assert engine.audit() == []


@pytest.mark.parametrize(("kv_cache_dtype", "codes"), [("fp8", torch.float8_e4m3fn), ("int8", torch.int8)])
def test_a_compiled_engine_over_an_8_bit_cache_matches_eager(
    compiling, make_engine, run_engine, prompt_of, greedy, kv_cache_dtype, codes
) -> None:
    """An 8-bit KV cache: the compiled step's C kernels read the codes in
    place (``cpu_decode``; fp8 rows are written by C too, int8 rows and
    scales by the reference); the eager engine takes the reference ops.
    Same tokens, same logprobs."""
    requests = mixed_workload(prompt_of, greedy)
    settings = dict(kv_cache_dtype=kv_cache_dtype, max_batch_size=4, max_num_batched_tokens=16)
    eager = run_engine(make_engine(enforce_eager=True, **settings), requests)
    engine = make_engine(**settings)
    assert engine.worker.compiled is not None and engine.worker.tensors.k_cache.dtype == codes
    assert_same(run_engine(engine, requests), eager, requests)
    assert engine.audit() == []


def test_hybrid_sliding_window_model_compiles_the_same(
    compiling, tiny_hybrid_loaded, run_engine, prompt_of, greedy
) -> None:
    """Gemma 3: sliding and global layers, q/k norms, per-layer windows
    passed through the custom op."""
    requests = mixed_workload(prompt_of, greedy)

    def make(**kw):
        config = EngineConfig(
            max_batch_size=4, max_model_len=128, max_num_batched_tokens=16, block_size=4,
            device="cpu", attention_backend="ref", **kw,
        )  # fmt: skip
        return LLMEngine(config, tiny_hybrid_loaded)

    eager = run_engine(make(enforce_eager=True), requests)
    engine = make()
    assert engine.worker.compiled is not None
    assert_same(run_engine(engine, requests), eager, requests)


def test_enforce_eager_and_the_suite_switch_keep_it_eager(
    monkeypatch, make_engine
) -> None:
    monkeypatch.setenv("PAGED_COMPILE", "1")
    assert make_engine(enforce_eager=True).worker.compiled is None
    monkeypatch.setenv("PAGED_COMPILE", "0")
    assert make_engine().worker.compiled is None


def test_models_whose_forward_syncs_with_the_host_stay_eager(monkeypatch) -> None:
    """The experts' grouped path reads routing counts on the host: a
    full-graph compile of it would fail at warm-up."""
    monkeypatch.setenv("PAGED_COMPILE", "1")
    config, cpu = EngineConfig(device="cpu"), torch.device("cpu")
    assert compiles_forward(LlamaForCausalLM, config, cpu, "ref")
    for family in (MixtralForCausalLM, Qwen3MoeForCausalLM):
        assert not compiles_forward(family, config, cpu, "ref"), family.__name__
    assert not compiles_forward(LlamaForCausalLM, config, cpu, "triton")
    assert not compiles_forward(LlamaForCausalLM, EngineConfig(tensor_parallel_size=2), cpu, "ref")


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_model_compiles_its_linears_to_the_gemm_template(
    compiling, tiny_model_dir, run_engine, prompt_of, greedy, method
) -> None:
    """Packed int8/int4 weights lower to inductor's C++ GEMM template (not
    aten's kernels, 1.5-9x slower; one row: cpu_gemv where it applies), compute the dequantized product within
    the format's tolerance (bfloat16 activations: 1e-2 of the spread) and
    decode. Each path is ~0.5% of the spread from the float32 product
    (both round activations and outputs to bfloat16, in different orders):
    int8 decodes the eager engine's tokens; int4's coarser weights give the
    tiny random model near-ties that either path may break, so only its
    layers are compared."""
    loaded = load_model(tiny_model_dir, torch.float32, "cpu", quantization=method)
    layer = loaded.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantizedLinear) and layer.kernel in PACKED_CPU_KERNELS
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    weight = (
        load_model(tiny_model_dir, torch.float32, "cpu").model.model.layers[0].mlp.down_proj.weight
    )
    bits, group = (8, None) if method == "int8" else (4, 128)  # the online methods' formats
    dense = F.linear(x, quantize_int(weight, bits, group).dequantize())
    with (
        torch.no_grad(),
        inductor_config.patch(freezing=True, **_gemm_template_options(loaded.model)),
    ):
        compiled = torch.compile(layer, fullgraph=True)(x)
    eager_layer = layer(x)
    assert (compiled - eager_layer).abs().max() <= 1e-2 * eager_layer.abs().max()
    assert (compiled - dense).abs().max() <= 1e-2 * dense.abs().max()
    requests = mixed_workload(prompt_of, greedy)

    def make(**kw):
        config = EngineConfig(
            max_batch_size=4, max_model_len=128, max_num_batched_tokens=16, block_size=4,
            device="cpu", attention_backend="ref", **kw,
        )  # fmt: skip
        return LLMEngine(config, loaded)

    eager = run_engine(make(enforce_eager=True), requests)
    before = counters["inductor"]["cpp_templated_kernel_counter"]
    with inductor_config.patch(force_disable_caches=True):  # codegen runs, not a cache hit
        engine = make()
    assert engine.worker.compiled is not None
    # 4 projections per layer, 2 layers, in the many-token graph; in the
    # one-token graph those cpu_gemv cannot take (it takes the rest: test_cpu_gemv.py)
    quantized = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    one_row_templates = sum(not m.one_row for m in quantized)
    assert len(quantized) == 2 * 4
    assert counters["inductor"]["cpp_templated_kernel_counter"] - before >= 2 * 4 + one_row_templates
    run = run_engine(engine, requests)
    for request_id, _, _ in requests:
        got, want = run.choices[(request_id, 0)], eager.choices[(request_id, 0)]
        assert got.error is None, got.error
        assert len(got.token_ids) == len(want.token_ids), request_id
        if method == "int8":
            assert got.token_ids == want.token_ids, request_id
            assert got.logprobs == pytest.approx(want.logprobs, abs=5e-2), request_id


class _Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, input_ids, position_ids, kv_cache):
        return self.lin(torch.ones(input_ids.shape[0], 8) * position_ids[:, None])


class _Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _Inner()
        self.head = torch.nn.Linear(8, 3)

    def compute_logits(self, hidden):
        return self.head(hidden).float()


@pytest.mark.parametrize(("dtype", "amx", "few_on_onednn"), [
    (torch.bfloat16, False, True), (torch.bfloat16, True, False), (torch.float32, False, False),
])  # fmt: skip
def test_few_row_graphs_take_onednn_for_bf16_without_amx(monkeypatch, dtype, amx, few_on_onednn) -> None:
    """Steps of 2..ROW_BUCKET rows run inductor's GEMM template as the
    one-token graph does, except bf16 weights on a CPU without AMX, where
    oneDNN's packed matmuls were faster (docs/cpu.md)."""
    import paged_server.engine.worker.compiled_forward as compiled_forward

    monkeypatch.setattr(compiled_forward, "cpu_has_amx", lambda: amx)
    forward = CompiledForward(_Outer().to(dtype))
    assert forward._static_freezing(1) is forward._freezing_one_row
    few = forward._static_freezing(ROW_BUCKET)
    assert few is (forward._freezing if few_on_onednn else forward._freezing_one_row)
    assert forward._freezing_for(ROW_BUCKET + 1) is forward._freezing


def test_many_compiled_engines_in_one_process() -> None:
    """Every instance's graphs share one code object's Dynamo cache: with the
    limit at one engine's worth, a second engine's graphs must still compile
    (the default limit of 8 failed the fifth engine of a benchmark)."""
    import torch._dynamo.config as dynamo_config

    # config.patch, not monkeypatch: pytest's undo deletes a config module's
    # attribute (it reads no old value there), which hides it from later engines.
    with dynamo_config.patch(recompile_limit=GRAPHS_PER_ENGINE), torch.inference_mode():
        for _ in range(2):
            forward = CompiledForward(_Outer())
            for rows in (1, 3, 9):  # every graph: one row, few rows, more
                out = forward.hidden_states(torch.zeros(rows, dtype=torch.long), torch.arange(rows), object())
                assert out.shape == (rows, 8)
                assert forward.compute_logits(out).shape == (rows, 3)


def test_rows_are_padded_to_buckets_the_warm_up_runs() -> None:
    """One row stays one; more are rounded up to a multiple of ROW_BUCKET
    (8), of 16 above 64 rows; ``row_buckets`` lists every count that gives,
    so a warm-up over them leaves serving no new row count (oneDNN builds a
    matmul per row count)."""
    assert ROW_BUCKET == 8
    assert [padded_rows(n) for n in (0, 1, 2, 8, 9, 64, 65, 80, 81)] == [0, 1, 8, 8, 16, 64, 80, 80, 96]
    assert row_buckets(100) == [1, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112]
    assert row_buckets(1) == [1]


class _RecordingView:
    """Records the rows ``attend`` is given; answers ``q + 1``."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def attend(self, layer_idx, q, k, v, *, scale, sliding_window=None, softcap=None):
        assert k.shape[0] == v.shape[0] == q.shape[0]
        self.rows.append(q.shape[0])
        return q + 1


def test_padding_rows_never_reach_the_view() -> None:
    """``paged::attention`` hands the view only the step's own rows (nothing
    written for padding) and gives the padding rows zeros."""
    view = _RecordingView()
    _step.view, _step.rows = view, 5
    try:
        q, k, v = torch.randn(8, 2, 4), torch.randn(8, 1, 4), torch.randn(8, 1, 4)
        out = attention_op(q, k, v, 0, 1.0, None, None)
    finally:
        _step.view = None
    assert view.rows == [5]
    assert torch.equal(out[:5], q[:5] + 1) and not out[5:].any()


def test_warm_up_runs_every_row_bucket(compiling, make_engine, monkeypatch) -> None:
    """The compiled engine's warm-up passes every padded row count up to
    its step budget through the model, and up to its batch size through
    the LM head, at least ROW_BUCKET + 1 rows (its few-row graph and its
    dynamic one: verify rows of speculative decoding pass the batch size)."""
    seen: list[int] = []
    tokens: list[int] = []
    real = CompiledForward.hidden_states

    def spy(self, input_ids, position_ids, kv_cache):
        seen.append(padded_rows(input_ids.shape[0]))
        tokens.append(input_ids.shape[0])
        return real(self, input_ids, position_ids, kv_cache)

    head: list[int] = []
    real_head = CompiledForward.compute_logits

    def spy_head(self, hidden):
        head.append(padded_rows(hidden.shape[0]))
        return real_head(self, hidden)

    monkeypatch.setattr(CompiledForward, "hidden_states", spy)
    monkeypatch.setattr(CompiledForward, "compute_logits", spy_head)
    engine = make_engine(max_batch_size=4, max_num_batched_tokens=3 * ROW_BUCKET)
    assert engine.worker.compiled is not None
    assert sorted(set(seen)) == row_buckets(3 * ROW_BUCKET) == [1, 8, 16, 24]
    assert sorted(set(head)) == [1, 8, 16]  # max_batch_size (4) rows padded to 8, and 9 rows
    # max_model_len 10: passes of at most 9 tokens, the top bucket (16) run once, by 9
    seen.clear()
    tokens.clear()
    make_engine(max_batch_size=4, max_num_batched_tokens=3 * ROW_BUCKET, max_model_len=10)
    assert sorted(seen) == [1, 8, 16] and max(tokens) == 9


def test_a_pool_barely_above_one_request_starts_and_serves(
    compiling, tiny_hybrid_loaded, run_engine, prompt_of, greedy, monkeypatch
) -> None:
    """Issue 53: the warm-up's throwaway prefill took max_model_len - 1
    tokens (63) in every KV cache group, so a compiled engine whose pool held
    fewer (here 16 blocks: 15 and the null block, shared by the hybrid
    model's 4 groups) failed to start with ``OutOfBlocksError``. It warms
    up every row bucket up to the longest prompt the pool holds (no step
    computes more), serves, and compiles nothing while serving."""
    seen: list[int] = []
    real = CompiledForward.hidden_states

    def spy(self, input_ids, position_ids, kv_cache):
        seen.append(padded_rows(input_ids.shape[0]))
        return real(self, input_ids, position_ids, kv_cache)

    monkeypatch.setattr(CompiledForward, "hidden_states", spy)
    # One request of a 6-token prompt and 10 generated tokens takes 13 blocks
    # of 4: 4 in the full group, 3 (a window of 8 and the next block) in each sliding one.
    config = EngineConfig(max_model_len=64, block_size=4, max_batch_size=2, device="cpu",
                          attention_backend="ref", num_gpu_blocks=13 + 1 + 2)
    engine = LLMEngine(config, tiny_hybrid_loaded)
    assert engine.worker.compiled is not None
    assert engine.capacity.longest_prompt == 12  # 15 // 4 groups = 3 blocks each
    assert sorted(set(seen)) == row_buckets(12) == [1, 8, 16]
    after_warm_up = compiled_graphs()
    requests = [(f"r{i}", prompt_of(6, i), greedy(10, logprobs=0)) for i in range(3)]
    run = run_engine(engine, requests)
    assert compiled_graphs() == after_warm_up, "serving compiled a new graph"
    eager = LLMEngine(dataclasses.replace(config, enforce_eager=True), tiny_hybrid_loaded)
    assert_same(run, run_engine(eager, requests), requests)
    assert engine.audit() == []


def test_speculative_verify_steps_on_the_few_row_graph_match_eager(
    compiling, make_cycling, run_engine, prompt_of, greedy
) -> None:
    """Verify steps (a sequence's token and its drafts: 2..5 rows) run the
    static few-row graph, beside decodes and prompt chunks of other
    sequences: the tokens and logprobs of the eager engine without
    speculation, and no graph compiled after warm-up."""
    def repeating(n: int, seed: int) -> list[int]:  # prompt lookup has something to copy
        block = prompt_of(n, seed)
        return block + block + block[: n // 2]

    requests = [(f"g{i}", repeating(6 + i, i), greedy(16, logprobs=1)) for i in range(3)]
    requests.append(("long", repeating(20, 9), greedy(8, logprobs=1)))  # chunks beside verify rows
    settings = dict(max_batch_size=4, max_num_batched_tokens=16)
    eager = run_engine(make_cycling(enforce_eager=True, **settings), requests)
    engine = make_cycling(
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                            "prompt_lookup_min": 2}, **settings,
    )  # fmt: skip
    assert engine.worker.compiled is not None
    after_warm_up = compiled_graphs()
    one_graph_rows: list[int] = []  # the steps whose layers and head ran as one graph
    logits = engine.worker.compiled.logits

    def counted(ids, positions, view):
        one_graph_rows.append(ids.shape[0])
        return logits(ids, positions, view)

    engine.worker.compiled.logits = counted
    run = run_engine(engine, requests)
    assert compiled_graphs() == after_warm_up, "serving compiled a new graph"
    assert engine.metrics()["spec_decode_num_accepted_tokens_total"] > 0
    # a verify step of one sequence samples every row: it runs as one graph too
    assert any(rows > 1 for rows in one_graph_rows) and 1 in one_graph_rows
    assert_same(run, eager, requests)
    assert engine.audit() == []


def test_a_compiled_draft_model_drafts_the_targets_tokens(
    compiling, make_cycling, run_engine, prompt_of, greedy, cycling_model_dir
) -> None:
    """A draft model's passes on the compiled CPU path (``Worker.greedy``: the
    layers, LM head and argmax in one graph up to 8 rows, the two graphs
    above): with the target itself as the draft every draft is kept, the
    tokens and logprobs are the eager engine's without speculation, and no
    graph is compiled after warm-up (the draft's own included)."""
    requests = [(f"g{i}", prompt_of(5 + 3 * i, i), greedy(16, logprobs=1)) for i in range(6)]
    requests.append(("long", prompt_of(40, 9), greedy(8, logprobs=1)))  # its catch-up in chunks
    settings = dict(max_batch_size=8, max_num_batched_tokens=16)
    eager = run_engine(make_cycling(enforce_eager=True, **settings), requests)
    spec = {"model": str(cycling_model_dir), "num_speculative_tokens": 3, "min_acceptance": 0,
            "disable_by_batch_size": 64}  # fmt: skip
    engine = make_cycling(speculative_config=spec, **settings)
    assert engine.worker.compiled is not None and engine._proposer.engine.worker.compiled is not None
    after_warm_up = compiled_graphs()
    run = run_engine(engine, requests)
    assert compiled_graphs() == after_warm_up, "serving compiled a new graph"
    m = engine.metrics()
    drafted, kept = m["spec_decode_num_draft_tokens_total"], m["spec_decode_num_accepted_tokens_total"]
    assert drafted > 0 and kept == drafted
    assert_same(run, eager, requests)
    assert engine.audit() == []
    engine.shutdown()


@pytest.mark.skipif(not few_row_gemm.preferred(), reason="the few-row kernel is not used on this CPU")
def test_bf16_speculation_keeps_every_token_on_the_few_row_kernel(
    compiling, cycling_model_dir, run_engine, prompt_of, greedy
) -> None:
    """In bf16 on a CPU that runs ``few_row_gemm`` (every projection and the
    LM head of the 1- and 8-row graphs), greedy output with prompt lookup
    is the output without it, token for token and logprob for logprob, at
    one stream and at three: a verify step's rows compute what one-row
    decodes compute (test_few_row_gemm checks the kernel's part: a row's
    bits do not depend on the rows beside it)."""

    def repeating(n: int, seed: int) -> list[int]:
        block = prompt_of(n, seed)
        return block + block + block[: n // 2]

    def engine(**spec: object) -> LLMEngine:
        config = EngineConfig(
            model=str(cycling_model_dir), dtype="bfloat16", device="cpu", attention_backend="ref",
            max_batch_size=4, max_model_len=128, block_size=4, **spec,
        )  # fmt: skip
        return LLMEngine(config)

    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    plain, speculating = engine(), engine(speculative_config=ngram)
    for e in (plain, speculating):
        assert e.worker.compiled is not None and hasattr(e.worker.model.lm_head, "few_row_weight")
    for requests in (
        [("one", repeating(8, 1), greedy(24, logprobs=1))],
        [(f"s{i}", repeating(6 + i, i), greedy(16, logprobs=1)) for i in range(3)],
    ):
        ref = run_engine(plain, requests)
        run = run_engine(speculating, requests)
        for request_id, _, _ in requests:
            got, want = run.choices[(request_id, 0)], ref.choices[(request_id, 0)]
            assert got.token_ids == want.token_ids, request_id
            assert got.logprobs == want.logprobs, request_id
    assert speculating.metrics()["spec_decode_num_accepted_tokens_total"] > 0
    for e in (plain, speculating):
        e.shutdown()
