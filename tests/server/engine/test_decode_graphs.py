"""Decode steps through the CUDA-graph path, proven on a CPU.

The capture itself needs a GPU (``cuda``-marked test below). What a capture
relies on can be checked here: the padded static-buffer path gives the same
results as the plain one, and its forward pass (the part a graph records)
never reads a tensor's value on the host and allocates the same shapes
whatever the step holds.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import pytest
import torch

from paged_server.engine.core.llm_engine import LLMEngine
from paged_server.engine.worker.decode_graphs import DecodeGraphs, capture_sizes
from paged_server.engine.worker.graph_safety import GraphSafety


def attach_graphs(engine: LLMEngine, capture: bool = False) -> DecodeGraphs:
    config = engine.config
    graphs = DecodeGraphs(
        engine.loaded.model,
        engine.worker.tensors,
        torch.device("cpu"),
        config.max_batch_size,
        -(-config.max_model_len // config.block_size),
        capture=capture,
    )
    engine.worker.graphs = graphs
    return graphs


def test_capture_sizes_pad_every_batch() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(64)
    assert sizes[-1] == 64 and sizes == sorted(set(sizes))


def test_padded_static_path_matches_the_plain_one(make_engine, run_engine, prompt_of, greedy) -> None:
    """Running sequences 1..7 at a time through buffers padded to 1, 2, 4, 8:
    the same tokens and logprobs as without graphs, and audits stay clean."""
    requests = [(f"r{i}", prompt_of(3 + 4 * i, i), greedy(6 + i, logprobs=0)) for i in range(7)]
    plain = run_engine(make_engine(), requests)
    engine = make_engine()
    graphs = attach_graphs(engine)
    used: list[int] = []
    real_run = graphs.run

    def counting_run(meta, input_ids):
        used.append(len(meta.starts))
        return real_run(meta, input_ids)

    graphs.run = counting_run  # type: ignore[method-assign]
    padded = run_engine(engine, requests)
    assert len(set(used)) >= 3 and all(graphs.padded(b) >= b for b in used)
    for key, choice in plain.choices.items():
        assert padded.choices[key].token_ids == choice.token_ids, key
        assert padded.choices[key].logprobs == pytest.approx(choice.logprobs, abs=1e-5)
    assert engine.audit() == []


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 to import paged_triton on a CPU"
)
@pytest.mark.parametrize("fused_layers", [False, True])
def test_triton_decode_forward_is_graph_safe(
    make_engine, run_engine, prompt_of, greedy, monkeypatch, fused_layers: bool
) -> None:
    """The decode forward with the Triton ops (their host wrappers for real,
    the kernel launches recorded instead of interpreted): no host reads, no
    value-dependent shapes, the same ops and shapes for two different steps.
    ``fused_layers``: the norms, RoPE and SiLU-mul as Triton kernels too, as
    the backend hands them out on CUDA."""
    from triton.runtime.interpreter import InterpretedFunction

    from paged_server.models.layers import use_layer_ops
    from paged_triton import layer_ops
    from paged_triton.triton_backend import TritonBackend

    if fused_layers:
        monkeypatch.setattr(TritonBackend, "layer_ops", lambda self, device_type: layer_ops)
    engine = make_engine(attention_backend="triton", max_batch_size=4)
    try:
        run_engine(engine, [("warm", prompt_of(5, 9), greedy(2))])  # kernels and lazy state ready
        launches: list[str] = []
        monkeypatch.setattr(
            InterpretedFunction, "run", lambda self, *a, grid, warmup, **kw: launches.append(self.__name__)
        )

        graphs = attach_graphs(engine)
        lens = (7, 13, 18, 4)
        seq_ids = [engine.kv_manager.allocate_sequence(prompt_of(n, 20 + n))[0] for n in lens]
        traces = []
        # Two steps that differ in batch, positions, page tables and lengths, both padded to 4.
        for batch, back in ((3, 1), (4, 3)):
            starts = [n - back for n in lens[:batch]]
            meta = engine.worker.tensors.metadata(engine.kv_manager.step_layout(seq_ids[:batch], starts, [1] * batch))
            graphs._load(meta, torch.arange(batch) + back, graphs.padded(batch))
            mode = GraphSafety(record=True)
            with torch.inference_mode(), mode, contextlib.ExitStack() as stack:
                for name in ("tolist", "numpy", "item", "cpu"):  # host reads the dispatcher misses
                    stack.enter_context(mock.patch.object(torch.Tensor, name, _forbidden(name)))
                graphs._forward(graphs.padded(batch))
            traces.append(mode.trace)
        assert launches, "the Triton kernels were never launched"
        fused = {"_rms_norm_kernel", "_rope_kernel", "_silu_mul_kernel"}
        assert (fused <= set(launches)) == fused_layers, set(launches)
        assert traces[0] == traces[1]
        for seq_id in seq_ids:
            engine.kv_manager.free_seq(seq_id)
    finally:
        use_layer_ops(engine.loaded.model, None)  # the shared tiny model back to eager


def _forbidden(name: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"Tensor.{name}() in the captured forward pass")

    return fail


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_graphs_replay_the_eager_results(prompt_of, greedy, tiny_model_dir) -> None:
    """On a GPU: engines with and without graphs give the same greedy tokens."""
    from paged_server.config import EngineConfig
    from paged_server.models import load_model

    loaded = load_model(tiny_model_dir, torch.float16, "cuda")
    requests = [(f"r{i}", prompt_of(3 + 4 * i, i), greedy(8)) for i in range(6)]
    out = {}
    for eager in (True, False):
        config = EngineConfig(
            max_batch_size=8, max_model_len=128, block_size=16, device="cuda",
            attention_backend="triton", enforce_eager=eager,
        )  # fmt: skip
        engine = LLMEngine(config, loaded)
        assert (engine.worker.graphs is None) == eager
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        out[eager] = tokens
        del engine  # its pool holds 90% of the GPU: the next engine sizes from what is free
    assert out[True] == out[False]
