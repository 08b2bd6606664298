"""The fused layer kernels (``paged_triton.layer_ops``) wired into the models:
an engine whose backend hands them out serves the same tokens as the eager
layers, and a decoder layer then runs no eager elementwise op but its last
residual add. On CUDA the Triton backend hands them out; here the kernels run
in Triton's interpreter, with the backend told to hand them out on a CPU."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from paged_server.models.layers import use_layer_ops
from paged_triton import layer_ops
from paged_triton.triton_backend import TritonBackend

pytestmark = pytest.mark.backend

# The eager ops the fused kernels replace (norms, RoPE, SiLU-mul).
ELEMENTWISE = {"pow", "mean", "rsqrt", "mul", "neg", "cat", "silu", "_to_copy", "add"}


def counting_ops() -> tuple[Any, dict[str, int]]:
    """``layer_ops`` with a call count per kernel."""
    calls = dict.fromkeys(("rms_norm", "add_rms_norm", "rope", "silu_mul"), 0)

    def counted(name: str) -> Any:
        def run(*args: Any) -> Any:
            calls[name] += 1
            return getattr(layer_ops, name)(*args)

        return run

    return types.SimpleNamespace(**{name: counted(name) for name in calls}), calls


@pytest.mark.parametrize("model", ["tiny_loaded", "tiny_hybrid_loaded"])
def test_fused_layers_serve_the_eager_tokens(
    model: str, request: pytest.FixtureRequest, run_engine, prompt_of, greedy, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """Llama (SwiGLU: every fusion) and Gemma 3 (unit-offset and q/k norms;
    GeGLU stays eager): greedy tokens equal, logprobs within float32 noise."""
    from paged_server.config import EngineConfig
    from paged_server.engine.core.llm_engine import LLMEngine

    loaded = request.getfixturevalue(model)
    requests = [(f"r{i}", prompt_of(5 + 9 * i, i), greedy(4, logprobs=0)) for i in range(2)]

    def engine() -> LLMEngine:
        cfg = EngineConfig(max_batch_size=4, max_model_len=128, max_num_batched_tokens=64,
                           block_size=4, device="cpu", attention_backend="triton")  # fmt: skip
        return LLMEngine(cfg, loaded)

    eager = run_engine(engine(), requests)
    ops, calls = counting_ops()
    monkeypatch.setattr(TritonBackend, "layer_ops", lambda self, device_type: ops)
    fused = run_engine(engine(), requests)
    for rid, want in eager.choices.items():
        got = fused.choices[rid]
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=1e-4)
    assert calls["rms_norm"] and calls["rope"]
    assert bool(calls["silu_mul"]) == (model == "tiny_loaded")  # Gemma's GeGLU: eager
    assert bool(calls["add_rms_norm"]) == (model == "tiny_loaded")  # Gemma's own layer adds after its norms
    monkeypatch.undo()
    use_layer_ops(loaded.model, None)  # the shared model back to eager for other tests


class _Names(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class _EchoView:
    """A cache view whose attention returns q: the layer's own ops are what is counted."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **_: Any) -> torch.Tensor:
        return q


def test_a_fused_llama_layer_runs_one_eager_elementwise_op(tiny_loaded) -> None:
    model = tiny_loaded.model
    layer = model.model.layers[0]
    x = torch.randn(3, model.config.hidden_size)
    cos, sin = model.model.rotary(torch.arange(3), x.dtype)
    names = {}
    try:
        for mode, ops in (("eager", None), ("fused", layer_ops)):
            use_layer_ops(model, ops)
            with torch.no_grad(), _Names() as seen:
                layer(x, cos, sin, _EchoView())
            names[mode] = [n for n in seen.names if n in ELEMENTWISE]
    finally:
        use_layer_ops(model, None)
    assert names["fused"] == ["add"]  # the MLP's residual add; everything else is in the kernels
    assert len(names["eager"]) >= 25, names["eager"]  # two norms, RoPE, SiLU-mul, two adds
