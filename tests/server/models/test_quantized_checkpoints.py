"""Quantized checkpoints load as vLLM loads them, detected with no flag.

compressed-tensors checkpoints are written by compressed-tensors' own
compressors (llmcompressor's on-disk format; llmcompressor itself would
pin older transformers) from tiny random models, with data-free min/max
scales as llmcompressor's W4A16 / W8A16 / FP8_DYNAMIC presets compute them;
transformers loading the same directory is the oracle. GPTQ and AWQ
directories are packed here in their own int32 layouts; their oracle is
transformers with the dequantized weights.

Tolerance: our int8/int4 CPU kernels take bfloat16 activations (see
models/quantization/linear.py), so logits agree to ~1e-2 of their spread,
not to float32 rounding; the fp8 path dequantizes exactly (1e-4).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from paged_server.models import CheckpointMismatchError, InvalidConfigError, load_model
from paged_server.models.quantization import QuantizedLinear, linear_formats, weight_bytes
from paged_server.models.tensor_parallel import TensorParallel

ct = pytest.importorskip("compressed_tensors")

VOCAB = 512
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=128,  # group size 128 needs 128-multiple input features
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)
PROMPT = torch.tensor([[3, 17, 101, 250, 7, 64, 300, 5]])


def _dense_linears(model: Any) -> list[str]:
    """Linear layers left dense (only the LM head should be)."""
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not isinstance(m, QuantizedLinear)
    ]


def _hf_model(family: str = "llama", seed: int = 0) -> Any:
    torch.manual_seed(seed)
    if family == "qwen3":
        return Qwen3ForCausalLM._from_config(
            Qwen3Config(**_COMMON), attn_implementation="eager"
        ).eval()
    return LlamaForCausalLM._from_config(LlamaConfig(**_COMMON), attn_implementation="eager").eval()


def _save(model: Any, path: Path, tokenizer_json: Path) -> Path:
    model.save_pretrained(path)
    (path / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    return path


def _write_compressed_tensors(
    path: Path, scheme_name: str, tokenizer_json: Path, family: str = "llama"
) -> tuple[Path, Any]:
    """The checkpoint, and the source model with compressed-tensors' own
    fake-quantized (quantize -> dequantize) weights: a second oracle."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    model = _hf_model(family)
    fake = _hf_model(family)
    scheme = preset_name_to_scheme(scheme_name, ["Linear"])
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    for module in model.modules():
        s = getattr(module, "quantization_scheme", None)
        if s is None:
            continue
        args, w = s.weights, module.weight.detach()
        if args.strategy == "group":
            w = w.reshape(w.shape[0], -1, args.group_size)
            lo, hi = w.amin(-1), w.amax(-1)
        elif args.strategy == "channel":
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        scale, zero = calculate_qparams(lo, hi, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
        if hasattr(module, "input_scale"):  # static activation scale (FP8): any value loads
            module.input_scale.data.fill_(0.05)
        zp = getattr(module, "weight_zero_point", None)
        name = next(n for n, m in model.named_modules() if m is module)
        with torch.no_grad():
            fake.get_submodule(name).weight.copy_(
                fake_quantize(module.weight, module.weight_scale, zp, args)
            )
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    _save(model, path, tokenizer_json)
    compressor.update_config(str(path))
    return path, fake


def _logits(path: Path, **kw: Any) -> tuple[torch.Tensor, Any]:
    loaded = load_model(path, torch.float32, **kw)
    with torch.no_grad():
        return loaded.model(PROMPT, torch.arange(PROMPT.shape[1])[None])[0], loaded


def _close(ours: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    spread = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= rel * spread, f"max |diff| {err:.3g} > {rel} x {spread:.3g}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)) or rel > 1e-3


CT_CASES = {
    # scheme: (format, kernel the CPU runs, tolerance relative to the logits'
    # spread, expected bits). Against transformers, FP8 gets 5e-2: it (like
    # vLLM on a GPU) quantizes activations to fp8 per token; we keep them in
    # the compute dtype (weight-only arithmetic on CPU).
    "W4A16": ("pack-quantized", "int4pack_mm", 2e-2, 4),
    "W4A16_ASYM": ("pack-quantized", "int4pack_mm", 2e-2, 4),
    # W8A16 is group 128 in compressed-tensors 0.20: a single group runs the
    # per-channel kernel, several groups one product per group.
    "W8A16": ("pack-quantized", "int8pack_mm", 2e-2, 8),
    "FP8_DYNAMIC": ("float-quantized", "dequantize", 1e-4, 8),
    "FP8": ("float-quantized", "dequantize", 1e-4, 8),
}


@pytest.mark.parametrize("scheme", list(CT_CASES))
def test_compressed_tensors_matches_transformers(
    scheme: str, tmp_path: Path, tokenizer_json: Path
) -> None:
    fmt, kernel, rel, bits = CT_CASES[scheme]
    path, fake = _write_compressed_tensors(tmp_path / scheme, scheme, tokenizer_json)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == fmt
    ours, loaded = _logits(path)
    with torch.no_grad():
        _close(ours, fake(PROMPT).logits[0], rel)
    if scheme.endswith("ASYM"):
        # transformers 5.24 + compressed-tensors 0.20 cannot load packed zero
        # points (it expects them unpacked: a size mismatch); vLLM can.
        ref = None
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = hf(PROMPT).logits[0].float()
    formats = linear_formats(loaded.model)
    assert all(f.endswith(f"({kernel})") or " g" in f for f in formats), formats
    assert any(f.endswith(f"({kernel})") for f in formats), formats
    assert _dense_linears(loaded.model) == ["lm_head"]  # every decoder linear is quantized
    assert loaded.quantization is not None and loaded.quantization.name == "compressed-tensors"
    if ref is not None:
        _close(ours, ref, 5e-2 if scheme.startswith("FP8") else rel)
    q_layers = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    dense16 = sum(2 * m.in_features * m.out_features for m in q_layers)
    quant = sum(weight_bytes(m) for m in q_layers)
    assert dense16 / quant >= {8: 1.9, 4: 3.5}[bits], (dense16, quant)


def test_compressed_tensors_qwen3(tmp_path: Path, tokenizer_json: Path) -> None:
    path, _ = _write_compressed_tensors(tmp_path / "q", "W4A16", tokenizer_json, family="qwen3")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(PROMPT).logits[0].float()
    _close(_logits(path)[0], ref, 2e-2)


def _pack(values: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """int32 words from unsigned 4-bit values along the last dim (8 a word)."""
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, 8)
    if order is not None:
        v = v[..., order]  # word nibble i holds column order[i]
    words = (v << (torch.arange(8) * 4)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _int4_asym(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ/AWQ-style asymmetric min/max: unsigned q, zero, fp16 scale per group."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8).half().float()
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15)
    return q.reshape(n, k).long(), zero.long(), scale


def _write_int4_layout(kind: str, path: Path, tokenizer_json: Path) -> tuple[Path, Any]:
    """A GPTQ (v1) or AWQ (GEMM) checkpoint and the dense oracle model."""
    from safetensors.torch import save_file

    model = _hf_model()
    oracle = _hf_model()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear) or name == "lm_head":
                continue
            q, zero, scale = _int4_asym(module.weight, 128)
            dense = (q - zero.repeat_interleave(128, 1)) * scale.repeat_interleave(128, 1)
            oracle.get_submodule(name).weight.copy_(dense)
            del state[f"{name}.weight"]
            if kind == "gptq":
                state[f"{name}.qweight"] = _pack(
                    q.T.reshape(-1, 8, q.shape[0]).transpose(1, 2)
                ).T.contiguous()
                state[f"{name}.qzeros"] = _pack(zero.T - 1)  # v1 stores zero - 1
                state[f"{name}.g_idx"] = (torch.arange(q.shape[1]) // 128).to(torch.int32)
            else:
                order = [0, 2, 4, 6, 1, 3, 5, 7]
                state[f"{name}.qweight"] = _pack(q.T, order)
                state[f"{name}.qzeros"] = _pack(zero.T, order)
            state[f"{name}.scales"] = scale.T.half().contiguous()
    path.mkdir()
    model.config.save_pretrained(path)
    save_file(state, str(path / "model.safetensors"))
    (path / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False}
        if kind == "gptq"
        else {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 128,
            "zero_point": True,
            "version": "gemm",
        }
    )
    (path / "config.json").write_text(json.dumps(config))
    return path, oracle


@pytest.mark.parametrize("kind", ["gptq", "awq"])
def test_gptq_awq_layouts_match_dequantized_transformers(
    kind: str, tmp_path: Path, tokenizer_json: Path
) -> None:
    path, oracle = _write_int4_layout(kind, tmp_path / kind, tokenizer_json)
    with torch.no_grad():
        ref = oracle(PROMPT).logits[0]
    ours, loaded = _logits(path)
    formats = linear_formats(loaded.model)  # K = 128 reads as per-channel
    assert _dense_linears(loaded.model) == ["lm_head"]
    assert all(f.startswith("int4 ") and f.endswith("asym (int4pack_mm)") for f in formats)
    _close(ours, ref, 2e-2)
    # the flag may name the checkpoint's method (vLLM's marlin alias too), not another one
    _logits(path, quantization=f"{kind}_marlin")
    with pytest.raises(InvalidConfigError, match=f"quantized with {kind}"):
        load_model(path, quantization="int8")


@pytest.mark.parametrize("scheme", ["W4A16", "FP8_DYNAMIC"])
def test_tensor_parallel_shards_carry_their_scales(
    scheme: str, tmp_path: Path, tokenizer_json: Path
) -> None:
    """Each rank's quantized slice dequantizes to the same slice of the whole
    layer (column layers split rows, row layers split input groups)."""
    path, _ = _write_compressed_tensors(tmp_path / scheme, scheme, tokenizer_json)
    whole = load_model(path)
    ranks = [load_model(path, tp=TensorParallel(r, 2)) for r in range(2)]

    def dense(model: Any, name: str) -> torch.Tensor:
        m = model.get_submodule(name)
        m.tp = TensorParallel()  # this rank's partial product, no all-reduce
        with torch.no_grad():  # the layer's own kernel applied to the identity
            return m(torch.eye(m.in_features)).T

    for name, module in whole.model.named_modules():
        if not isinstance(module, QuantizedLinear):
            continue
        parts = [dense(r.model, name) for r in ranks]
        if name.endswith(("o_proj", "down_proj")):  # row-parallel: input slices
            torch.testing.assert_close(
                torch.cat(parts, 1), dense(whole.model, name), rtol=0, atol=0
            )
            continue
        # column-parallel: output rows, per stacked projection when fused (q/k/v)
        sizes = [s.size for s in module.slices] if module.slices else [module.out_features]
        rank_sizes = [[s.size for s in r.model.get_submodule(name).slices or []] for r in ranks]
        splits = [
            p.split(rs or [p.shape[0]], dim=0) for p, rs in zip(parts, rank_sizes, strict=True)
        ]
        for i, full in enumerate(dense(whole.model, name).split(sizes, dim=0)):
            got = torch.cat([sp[i] for sp in splits], 0)
            torch.testing.assert_close(got, full, rtol=0, atol=0)


def test_group_cut_by_tensor_parallel_is_refused(tmp_path: Path, tokenizer_json: Path) -> None:
    path, _ = _write_compressed_tensors(tmp_path / "w4", "W4A16", tokenizer_json)
    with pytest.raises(CheckpointMismatchError, match="cut quantization groups"):
        load_model(path, tp=TensorParallel(0, 4))
