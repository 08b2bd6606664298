"""Online quantization (``--quantization fp8|int8|int4``) and the
``QuantizedLinear`` kernels.

The oracle for a whole model is transformers with every decoder linear
weight replaced by its quantize -> dequantize image: the quantized model
must compute that model, up to the bfloat16 activations of the CPU int8/int4
kernels (2e-2 of the logits' spread; fp8 dequantizes exactly: 1e-4).
"""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from paged_server.config import EngineConfig
from paged_server.entrypoints.llm import LLM
from paged_server.models import InvalidConfigError, load_model
from paged_server.models.quantization import QuantizedLinear, QuantizedWeight, linear_formats
from paged_server.models.quantization.weights import quantize_fp8, quantize_int
from paged_server.sampling_params import SamplingParams

DEQUANT = {
    "int8": lambda w: quantize_int(w, 8, None),
    "int4": lambda w: quantize_int(w, 4, 128 if w.shape[1] % 128 == 0 else None),
    "fp8": quantize_fp8,
}
KERNEL = {"int8": "int8pack_mm", "int4": "int4pack_mm", "fp8": "dequantize"}


def _dense_linears(model: Any) -> list[str]:
    """Linear layers left dense (only the LM head should be)."""
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not isinstance(m, QuantizedLinear)
    ]


def _weight(n: int, k: int, bits: int, group: int, asym: bool, seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1)
    q = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
    zeros = torch.randint(lo, hi, (n, k // group), generator=g, dtype=torch.int8) if asym else None
    return QuantizedWeight(q, scales, zeros, bits, group)


@pytest.mark.parametrize(
    ("bits", "group", "asym", "kernel"),
    [
        (8, 256, False, "int8pack_mm"),  # per channel
        (8, 128, False, "int8pack_mm_grouped"),  # one per-channel product per group
        (8, 128, True, "dequantize"),  # int8 zero points: no packed kernel
        (4, 128, False, "int4pack_mm"),
        (4, 128, True, "int4pack_mm"),
        (4, 256, False, "int4pack_mm"),  # per channel: scales repeated per 256
        (4, 512, True, "int4pack_mm"),  # coarser groups: scales repeated per 256
        (4, 48, True, "dequantize"),  # no kernel group fits: two values a byte
    ],
)
def test_kernel_computes_the_dequantized_weight(
    bits: int, group: int, asym: bool, kernel: str
) -> None:
    k = 512 if group == 512 else 96 * 4 if group == 48 else 256
    w = _weight(64, k, bits, group, asym)
    bias = torch.randn(64)
    layer = QuantizedLinear(w, bias, torch.device("cpu"))
    assert layer.kernel == kernel
    x = torch.randn(3, 5, k)
    ref = F.linear(x, w.dequantize(), bias)
    out = layer(x)
    assert out.shape == ref.shape and out.dtype == torch.float32
    rel = 1e-5 if kernel == "dequantize" else 1e-2  # bf16 activations
    assert (out - ref).abs().max() <= rel * ref.abs().max()
    stored = sum(b.numel() * b.element_size() for b in layer.buffers())
    # values at their bit width, plus a scale (and zero) per group
    assert stored <= 64 * k * bits // 8 + 64 * (k // group) * 8


@pytest.mark.parametrize(
    ("bits", "group", "kernel"),
    [(8, 256, "int8pack_mm"), (8, 128, "int8pack_mm_grouped"), (4, 128, "int4pack_mm")],
)
def test_packed_kernels_take_a_strided_bfloat16_input(bits: int, group: int, kernel: str) -> None:
    """bf16 activations (a CPU with bf16 units) reach the kernel without a
    cast, so a column slice must be made contiguous first: aten's int4
    kernel refuses a strided input."""
    layer = QuantizedLinear(_weight(64, 256, bits, group, False), None, torch.device("cpu"))
    assert layer.kernel == kernel
    wide = torch.randn(3, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x = wide[:, 128:384]
    assert not x.is_contiguous()
    torch.testing.assert_close(layer(x), layer(x.contiguous()), rtol=0, atol=0)


def _fake_quantized(hf_model: Any, method: str, ours: Any) -> Any:
    """transformers' model with each projection replaced by its quantize ->
    dequantize image, quantized together as our model stacks them (a fused
    q/k/v shares fp8's one per-tensor scale, as in vLLM)."""
    oracle = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, module in ours.named_modules():
            if not isinstance(module, QuantizedLinear):
                continue
            parent = name.rpartition(".")[0]
            slices = module.slices if module.slices and len(module.slices) > 1 else None
            names = [f"{parent}.{s.name}" for s in slices] if slices else [name]
            linears = [oracle.get_submodule(n) for n in names]
            joint = torch.cat([lin.weight for lin in linears])
            dense = DEQUANT[method](joint).dequantize()
            for lin, part in zip(
                linears, dense.split([lin.out_features for lin in linears]), strict=True
            ):
                lin.weight.copy_(part)
    return oracle


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_online_quantization_computes_the_fake_quantized_model(
    checkpoint: Any, method: str
) -> None:
    loaded = load_model(checkpoint.path, torch.float32, quantization=method)
    formats = linear_formats(loaded.model)
    assert _dense_linears(loaded.model) == ["lm_head"]  # every decoder linear is quantized
    assert all(f.endswith(f"({KERNEL[method]})") for f in formats), formats
    assert not isinstance(loaded.model.lm_head, QuantizedLinear)  # vLLM keeps the head dense
    ids = torch.tensor([[5, 80, 33, 190, 7, 402, 11, 9, 250, 3]])
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        ours = loaded.model(ids, pos)[0]
        ref = _fake_quantized(checkpoint.hf_model, method, loaded.model)(ids).logits[0].float()
    rel = 1e-4 if method == "fp8" else 2e-2
    assert (ours - ref).abs().max() <= rel * ref.abs().max()


def test_wrong_quantization_names_are_refused(checkpoint: Any) -> None:
    with pytest.raises(ValueError, match="quantization: must be one of"):
        EngineConfig(quantization="int3").validate()
    with pytest.raises(InvalidConfigError, match="has no quantization_config"):
        load_model(checkpoint.path, quantization="gptq")


@pytest.mark.parametrize("pool", ["paged", "contiguous"])
def test_engine_states_the_weight_format_and_decodes_like_the_model(
    checkpoints: dict[str, Any], pool: str, caplog: pytest.LogCaptureFixture
) -> None:
    path: Path = checkpoints["llama"].path
    prompt = [5, 80, 33, 190, 7, 402, 11, 9]
    config = dict(kv_cache_backend=pool, device="cpu", max_model_len=64, max_batch_size=2)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    caplog.set_level(logging.INFO, logger="paged_server.engine.core.llm_engine")
    with LLM(str(path), quantization="int8", **config) as llm:
        result = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy, use_tqdm=False)
    out = result[0].outputs[0].token_ids
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:"))
    assert "int8 per-channel (online)" in line
    assert re.search(r"\d+ layers int8 per-channel \(int8pack_mm\)", line), line
    assert "x smaller" in line
    loaded = load_model(path, torch.float32, quantization="int8")
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            logits = loaded.model(torch.tensor([ids]), torch.arange(len(ids))[None])
            ids.append(int(logits[0, -1].argmax()))
    assert list(out) == ids[len(prompt) :]


# Run in a child process: before the shape checks, aten's int8 kernel read
# past rows of 104 features (a segfault would take pytest down with it).
_SERVE_GREEDY = """
import sys, torch
from paged_server.entrypoints.llm import LLM
from paged_server.models import load_model
from paged_server.models.quantization import linear_formats
from paged_server.sampling_params import SamplingParams
path, method, out = sys.argv[1:4]
prompt = [5, 80, 33, 190, 7, 402, 11, 9]
loaded = load_model(path, torch.float32, quantization=method)
with torch.no_grad():
    logits = loaded.model(torch.tensor([prompt]), torch.arange(len(prompt))[None])[0]
greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
with LLM(path, quantization=method, device="cpu", max_model_len=64, max_batch_size=2) as llm:
    result = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy, use_tqdm=False)
tokens = list(result[0].outputs[0].token_ids)
torch.save({"logits": logits, "tokens": tokens, "formats": linear_formats(loaded.model)}, out)
"""


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize(
    "shape", [{"hidden_size": 104}, {"intermediate_size": 99}], ids=["hidden104", "inter99"]
)
def test_shapes_the_packed_kernels_cannot_run_fall_back_and_serve(
    method: str, shape: dict[str, int], tmp_path: Path, tokenizer_json: Path
) -> None:
    """Input features that are not a multiple of 16 (int8: aten's kernel
    read past each row: SIGSEGV from 2 rows, garbage at 1) and output rows
    that are not (int4: aten's packing raised), or an odd number of inputs
    (int4: refused), dequantize that layer instead, and the engine serves
    the fake-quantized model's greedy tokens."""
    import subprocess
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    hf = LlamaForCausalLM._from_config(
        LlamaConfig(**{**config, **shape}), attn_implementation="eager"
    ).eval()
    hf.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    out = tmp_path / "served.pt"
    child = subprocess.run(
        [sys.executable, "-c", _SERVE_GREEDY, str(tmp_path), method, str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0, f"exit {child.returncode}: {child.stderr[-2000:]}"
    served = torch.load(out)
    assert any(f.endswith("(dequantize)") for f in served["formats"]), served["formats"]
    ours = load_model(tmp_path, torch.float32, quantization=method).model  # the layer layout
    oracle = _fake_quantized(hf, method, ours)
    prompt = [5, 80, 33, 190, 7, 402, 11, 9]
    with torch.no_grad():
        ref = oracle(torch.tensor([prompt + served["tokens"]])).logits[0].float()
    assert (served["logits"] - ref[: len(prompt)]).abs().max() <= 2e-2 * ref.abs().max()
    # each served token is the oracle's greedy choice, up to the kernels' tolerance
    for step, token in enumerate(served["tokens"]):
        row = ref[len(prompt) - 1 + step]
        assert row.max() - row[token] <= 2e-2 * ref.abs().max(), (step, token, int(row.argmax()))
