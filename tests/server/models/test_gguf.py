"""GGUF files (``--model file.gguf``) load into the same models as their
safetensors checkpoints and give the same greedy tokens.

Two kinds of file, from the same tiny f16 checkpoints: ones llama.cpp's
own ``convert_hf_to_gguf.py`` writes (from the llama-cpp-python sdist,
fetched with pip once into the paged cache; skipped where that cannot be
had), and ones written here with the ``gguf`` package's GGUFWriter, so that
loading is covered everywhere. Q4_0 comes from ``llama-quantize`` where a
llama.cpp build is cached, else from gguf-py's port of ggml's reference
quantizer (the converter itself writes no Q4_0).
"""

from __future__ import annotations

import copy
import json
import logging
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np
import pytest
import torch
import transformers

from paged_server.config import EngineConfig
from paged_server.default_model.builder import CHAT_TEMPLATE
from paged_server.entrypoints.cli import main
from paged_server.entrypoints.llm import LLM
from paged_server.entrypoints.openai.app import ServerSettings
from paged_server.entrypoints.openai.server import ServerThread, build_engine
from paged_server.models import LoadedModel, load_model
from paged_server.models.errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    InvalidConfigError,
    UnsupportedArchitectureError,
)
from paged_server.models.gguf import GGUFFile
from paged_server.models.gguf_reader import read_gguf
from paged_server.models.gguf_tensors import GGUFTensors, unpermute_rows
from paged_server.models.loader import read_model_config
from paged_server.models.quantization import QuantizedLinear
from paged_server.sampling_params import SamplingParams
from paged_server.tokenizer import Tokenizer
from peers import llamacpp as lc

VOCAB = 512  # the tiny checkpoints' (conftest.py)
GGUF_FAMILIES = ("llama", "qwen3", "qwen2")  # llama: permuted q/k rows, Llama 3 RoPE factors
PROMPTS = 16
STEPS = 8
Q = gguf.GGMLQuantizationType
TYPES = {"f16": Q.F16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
TEXTS = [
    "Hello world, def foo(): return 1",
    "  two  spaces\nand a newline",
    "<|im_start|>user\nhi<|im_end|>",
]


# -- the checkpoints ---------------------------------------------------------------------------
# The successor each token has in the sequences the "taught" checkpoints learn.
SUCCESSOR = torch.randperm(VOCAB - 3, generator=torch.Generator().manual_seed(0)) + 3


def chain(length: int, seed: int) -> list[int]:
    """A sequence of the taught language: a random token, then successors."""
    ids = [int(torch.randint(3, VOCAB, (1,), generator=torch.Generator().manual_seed(seed)))]
    while len(ids) < length:
        ids.append(int(SUCCESSOR[ids[-1] - 3]))
    return ids


def teach(model: Any, steps: int = 60) -> Any:
    """A few Adam steps on chains, so that the model's greedy choices have
    the margins a trained model's have (a random model's top two logits are
    near ties that any 4-bit rounding flips, whatever the loader does)."""
    gen = torch.Generator().manual_seed(1)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = torch.tensor(
            [chain(16, int(torch.randint(1 << 30, (1,), generator=gen))) for _ in range(8)]
        )
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def f16_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[str, Any]
) -> Callable[..., Path]:
    """``f16_checkpoint(family, taught=False)``: the family's tiny checkpoint
    (``taught``: after ``teach``) saved in float16, what an f16 GGUF holds
    exactly, with a ChatML template and ``<|im_end|>`` as EOS."""
    made: dict[tuple[str, bool], Path] = {}

    def make(family: str, taught: bool = False) -> Path:
        if (family, taught) not in made:
            path = tmp_path_factory.mktemp(f"f16-{family}")
            model = copy.deepcopy(checkpoints[family].hf_model)
            (teach(model) if taught else model).half().save_pretrained(path)
            (path / "tokenizer.json").write_bytes(
                (checkpoints[family].path / "tokenizer.json").read_bytes()
            )
            config = {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}
            (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
            made[family, taught] = path
        return made[family, taught]

    return make


@pytest.fixture
def same_greedy_tokens(
    prompt_of: Callable[[int, int], list[int]], pool_of: Any, greedy_pool: Any
) -> Callable[[str, LoadedModel, LoadedModel], None]:
    """``same_greedy_tokens(kind, gguf, checkpoint)``: 16 prompts run greedy
    through a paged KV cache (the serving path) on both. f16 holds the
    checkpoint's weights exactly: every token of random prompts agrees. The
    8-/4-bit formats change the weights: the first token of >= 12 of 16
    prompts in the taught language (the checkpoint's ``taught`` variant)."""

    def check(kind: str, ours: LoadedModel, theirs: LoadedModel) -> None:
        exact = kind == "f16"
        prompts = [(prompt_of if exact else chain)(4 + i, 100 + i) for i in range(PROMPTS)]
        runs = [
            [greedy_pool(m.model, pool_of("paged", m), p, STEPS)[0] for p in prompts]
            for m in (ours, theirs)
        ]
        if exact:
            assert runs[0] == runs[1]
            return
        agree = sum(a[0] == b[0] for a, b in zip(*runs, strict=True))
        assert agree >= 12, f"{kind}: first tokens agree on {agree} of {PROMPTS} prompts"

    return check


# -- GGUF files written here -------------------------------------------------------------------
def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute`` (q/k rows for ggml's RoPE)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(checkpoint: Path, out: Path, kind: str, **meta: Any) -> Path:
    """``checkpoint`` as a GGUF file in ``kind`` (every 2-D weight in it, as
    ``llama-quantize --pure``), named and permuted as llama.cpp's converter
    does, with the tokenizer's vocabulary, merges and the chat template.
    ``meta`` overrides: ``arch``, ``tokenizer_model``, ``tensor_type``, ``split``;
    ``pooling_type`` writes an embedding model's file (no LM head, llama.cpp's
    ``<arch>.pooling_type``), as the converter does for one."""
    from safetensors.numpy import load_file

    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    arch = meta.get("arch", config["model_type"])
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10_000.0)))
    w.add_file_type(int({"f16": 1, "q8_0": 7, "q4_0": 2}[kind]))
    tok = json.loads((checkpoint / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["id"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model(meta.get("tokenizer_model", "gpt2"))
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in specials else 1 for _, i in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(tok["model"]["vocab"]["<|im_end|>"])
    w.add_chat_template(CHAT_TEMPLATE)
    if "split" in meta:  # as llama-gguf-split writes each part's header
        w.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_NO, 0)
        w.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, meta["split"])
    if "pooling_type" in meta:
        w.add_pooling_type(meta["pooling_type"])
    model_arch = gguf.MODEL_ARCH[config["model_type"].upper()]
    table = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_factors(rope, head_dim))
    for name, data in load_file(str(checkpoint / "model.safetensors")).items():
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = llama_cpp_permute(data, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = llama_cpp_permute(data, kv_heads)
        target = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if target == "output.weight" and "pooling_type" in meta:
            continue
        qtype = meta.get("tensor_type", TYPES[kind]) if data.ndim == 2 else Q.F32
        if target == "output.weight" and qtype == Q.Q4_0:
            qtype = Q.Q8_0  # llama-quantize's Q6_K for the LM head, Q8_0 where rows are not 256s
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(target, data.astype(np.float32 if qtype == Q.F32 else np.float16))
        elif qtype == Q.I8:
            w.add_tensor(target, data.astype(np.int8))
        else:
            w.add_tensor(
                target, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def llama3_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """The converter's ``rope_freqs``: each frequency's Llama 3 divisor."""
    freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    old, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    out = np.where(
        wavelen < old / high,
        1.0,
        np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    return out.astype(np.float32)


# f16 on every family; the 8-/4-bit files on the two the converter test runs too
# (Qwen 2's biases through the int kernels: the oracle test below).
WRITTEN = [(f, "f16") for f in GGUF_FAMILIES] + [
    (f, k) for f in ("llama", "qwen3") for k in ("q8_0", "q4_0")
]


@pytest.mark.parametrize(("family", "kind"), WRITTEN)
def test_written_gguf_gives_the_checkpoints_greedy_tokens(
    family: str, kind: str, f16_checkpoint: Callable[..., Path], tmp_path: Path,
    same_greedy_tokens: Callable[[str, LoadedModel, LoadedModel], None],
) -> None:  # fmt: skip
    checkpoint = f16_checkpoint(family, taught=kind != "f16")
    loaded = load_model(write_gguf(checkpoint, tmp_path / f"{kind}.gguf", kind))
    same_greedy_tokens(kind, loaded, load_model(checkpoint))


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_q8_0_and_q4_0_layers_are_int8_int4_weights_equal_to_ggufs_own_dequantization(
    kind: str, f16_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = write_gguf(f16_checkpoint("llama"), tmp_path / f"{kind}.gguf", kind)
    loaded = load_model(path)
    bits = {"q8_0": 8, "q4_0": 4}[kind]
    layers = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 2 * 4 and {m.format for m in layers} == {
        f"int{bits} g32"
    }  # qkv, o, gate_up, down
    assert loaded.quantization is not None and kind.upper() in loaded.quantization.description
    file = GGUFFile(path)
    config = loaded.config
    names = [f"model.layers.{i}.{p}.weight" for i in range(2) for p in
             ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj")]  # fmt: skip
    tensors = GGUFTensors(file, names, config.num_heads, config.num_kv_heads)
    for name in names:
        raw = file.tensors[tensors.gguf_name[name]]
        theirs = torch.from_numpy(gguf.quants.dequantize(raw.data, raw.tensor_type))
        if "_attn.q" in name or "_attn.k" in name:
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            theirs = theirs[unpermute_rows(theirs.shape[0], heads)]
        weight = tensors.quantized(name)
        assert weight is not None and weight.bits == bits and weight.group_size == 32
        torch.testing.assert_close(weight.dequantize(), theirs, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantized_gguf_computes_the_checkpoint_with_ggufs_rounded_weights(
    family: str, kind: str, f16_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """The oracle: transformers with each weight replaced by its Q8_0/Q4_0
    rounding (gguf-py's quantize -> dequantize, on the checkpoint's own
    tensors); ours computes that model up to the bf16 activations of the
    int8/int4 kernels (2e-2 of the logits' spread, as online quantization)."""
    checkpoint = f16_checkpoint(family)
    loaded = load_model(write_gguf(checkpoint, tmp_path / f"{kind}.gguf", kind))
    oracle = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        for name, param in oracle.named_parameters():
            qtype = (
                Q.Q8_0 if kind == "q8_0" or name == "lm_head.weight" else Q.Q4_0
            )  # as write_gguf
            if param.ndim == 2:
                rounded = gguf.quants.dequantize(gguf.quants.quantize(param.numpy(), qtype), qtype)
                param.copy_(torch.from_numpy(rounded))
    ids = torch.tensor([[5, 80, 33, 190, 7, 402, 11, 9, 250, 3]])
    with torch.no_grad():
        ours = loaded.model(ids, torch.arange(ids.shape[1])[None])[0]
        ref = oracle(ids).logits[0].float()
    assert (ours - ref).abs().max() <= 2e-2 * ref.abs().max()


@pytest.mark.parametrize("kind", ["f16", "q4_0", "bf16"])
def test_the_header_reader_reads_what_ggufs_own_reader_reads(
    kind: str, f16_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """gguf_reader.py (one struct call per value) against gguf-py's GGUFReader."""
    extra = {"tensor_type": Q.BF16} if kind == "bf16" else {}
    path = write_gguf(
        f16_checkpoint("llama"), tmp_path / "x.gguf", "f16" if extra else kind, **extra
    )
    metadata, tensors = read_gguf(path)
    theirs = gguf.GGUFReader(str(path))
    assert metadata == {
        k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")
    }
    assert list(tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        ours = tensors[t.name]
        assert (ours.tensor_type, ours.shape, ours.n_bytes) == (
            t.tensor_type,
            tuple(t.shape.tolist()),
            t.n_bytes,
        )
        assert ours.data.dtype == t.data.dtype and np.array_equal(ours.data, t.data)
    load_model(path)  # bf16 included


def test_the_files_tokenizer_chat_template_and_eos_are_the_checkpoints(
    f16_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    checkpoint = f16_checkpoint("qwen3")
    loaded = load_model(write_gguf(checkpoint, tmp_path / "f16.gguf", "f16"))
    theirs = Tokenizer.from_dir(checkpoint)
    for text in TEXTS:
        assert loaded.tokenizer.encode(text) == theirs.encode(text)
        assert loaded.tokenizer.decode(theirs.encode(text), skip_special_tokens=False) == text
    assert loaded.chat_template == theirs.chat_template == CHAT_TEMPLATE
    assert loaded.eos_token_ids == [theirs.token_to_id("<|im_end|>")]


def test_an_unsupported_tensor_type_is_refused_by_name(
    f16_checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_gguf(f16_checkpoint("qwen3"), tmp_path / "i8.gguf", "f16", tensor_type=Q.I8)
    with pytest.raises(CheckpointMismatchError, match=r"tensor \S+ is I8, which .*supported: F32"):
        read_model_config(path)
    capsys.readouterr()  # the fixture's own output
    assert main(["serve", "--model", str(path), "--port", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is I8, which" in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_split_gguf_is_refused_with_how_to_merge_it(
    f16_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = write_gguf(f16_checkpoint("qwen3"), tmp_path / "m-00001-of-00002.gguf", "f16", split=2)
    with pytest.raises(
        InvalidConfigError, match="part 1 of 2 of a split GGUF.*llama-gguf-split --merge"
    ):
        read_model_config(path)


@pytest.mark.parametrize("keep", [0.5, 0.001])  # cut in the tensors, in the header
def test_a_truncated_file_is_refused_as_one(
    keep: float, f16_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = write_gguf(f16_checkpoint("qwen3"), tmp_path / "cut.gguf", "f16")
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CorruptCheckpointError, match="not a readable GGUF file.*truncated"):
        read_model_config(path)


def test_an_embedding_gguf_pools_as_its_checkpoint(
    f16_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """``--runner pooling`` on an embedding GGUF (mean pooling declared, no
    LM head): embeddings and ``token_embed`` rows are transformers' final-norm
    states of the f16 checkpoint (mean, normalized; each row normalized). A
    classifier is refused: a GGUF holds no score head."""
    checkpoint = f16_checkpoint("llama")
    path = write_gguf(checkpoint, tmp_path / "embed.gguf", "f16", pooling_type=gguf.PoolingType.MEAN)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    llm = LLM(str(path), runner="pooling", device="cpu", dtype="float32", max_model_len=64,
              max_num_batched_tokens=8, max_batch_size=2, block_size=4, num_gpu_blocks=64,
              enforce_eager=True)  # fmt: skip
    prompts = [list(range(3, 40)), [7, 8, 9]]
    embedded = llm.embed(prompts)
    per_token = llm.encode(prompts, pooling_task="token_embed")
    for prompt, one, rows in zip(prompts, embedded, per_token, strict=True):
        with torch.no_grad():
            states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
        expected = torch.nn.functional.normalize(states.mean(0), dim=-1)
        torch.testing.assert_close(torch.tensor(one.outputs.embedding), expected, atol=1e-4, rtol=0)
        expected_rows = torch.nn.functional.normalize(states, dim=-1)
        torch.testing.assert_close(rows.outputs.data, expected_rows, atol=1e-4, rtol=0)
    with pytest.raises(InvalidConfigError, match="GGUF file pools as an embedding model only"):
        load_model(path, pooling="classify")


def test_an_unsupported_architecture_is_refused_by_name(
    f16_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = write_gguf(f16_checkpoint("qwen3"), tmp_path / "gptneox.gguf", "f16", arch="gptneox")
    with pytest.raises(
        UnsupportedArchitectureError, match="'gptneox'.*supported: llama, qwen2, qwen3"
    ):
        read_model_config(path)


def test_serve_refuses_a_tokenizer_it_cannot_build_unless_tokenizer_is_given(
    f16_checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = f16_checkpoint("qwen3")
    path = write_gguf(checkpoint, tmp_path / "spm.gguf", "f16", tokenizer_model="llama")
    capsys.readouterr()  # the fixture's own output
    status = main(["serve", "--model", str(path), "--port", "0", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "'llama'" in err and "--tokenizer DIR" in err
    # With the flag, the directory's tokenizer and template serve the file's model.
    with LLM(str(path), tokenizer=str(checkpoint), device="cpu", max_model_len=64) as llm:
        out = llm.chat(
            [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3), use_tqdm=False
        )
    prompt = Tokenizer.from_dir(checkpoint).apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=True
    )
    assert out[0].prompt_token_ids == prompt and len(out[0].outputs[0].token_ids) >= 1


def test_serve_answers_chat_with_the_files_template_over_http(
    f16_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    checkpoint = f16_checkpoint("qwen3")
    path = write_gguf(checkpoint, tmp_path / "q8_0.gguf", "q8_0")
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", max_model_len=128,
                          attention_backend="ref", max_batch_size=4)  # fmt: skip
    server = ServerThread(build_engine(config), ServerSettings(model_name="tiny-gguf")).start()
    try:
        body = {"model": "tiny-gguf", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4, "temperature": 0}  # fmt: skip
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
        prompt = Tokenizer.from_dir(checkpoint).apply_chat_template(body["messages"], tokenize=True)
        assert reply["usage"]["prompt_tokens"] == len(prompt)  # the file's ChatML template
        assert reply["usage"]["completion_tokens"] >= 1
    finally:
        server.stop()


# -- GGUF files from llama.cpp's converter ----------------------------------------------------
@pytest.fixture(scope="module")
def converter() -> lc.LlamaCpp:
    """llama.cpp's converter: a cached tree's, else the sdist's converter
    files, fetched with pip once (skipped where neither can be had)."""
    try:
        return lc.converter_tree()
    except (OSError, subprocess.SubprocessError, tarfile.TarError, RuntimeError) as exc:
        pytest.skip(f"llama.cpp's convert_hf_to_gguf.py is not available: {exc}")


def converted(tree: lc.LlamaCpp, checkpoint: Path, kind: str, root: Path) -> Path:
    """``checkpoint`` as GGUF: f16 and Q8_0 by the converter, Q4_0 by
    ``llama-quantize`` where built, else requantized from f32 by gguf-py."""
    if kind != "q4_0" or tree.quantize.is_file():
        return lc.convert_to_gguf(tree, checkpoint, kind, root)
    return requantize(lc.convert_to_gguf(tree, checkpoint, "f32", root), root / "q4_0.gguf", Q.Q4_0)


def requantize(src: Path, out: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    """A copy of ``src`` (metadata and all) with every 2-D tensor in ``qtype``."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(out), arch=None)  # type: ignore[arg-type]
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == gguf.Keys.General.FILE_TYPE:
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_file_type(2)  # MOSTLY_Q4_0
    for t in reader.tensors:
        data = np.asarray(t.data)
        if data.ndim == 2:
            writer.add_tensor(
                t.name, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype
            )
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("kind", TYPES)
def test_converted_gguf_gives_the_checkpoints_greedy_tokens(
    family: str, kind: str, converter: lc.LlamaCpp, f16_checkpoint: Callable[..., Path],
    tmp_path: Path, same_greedy_tokens: Callable[[str, LoadedModel, LoadedModel], None],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    checkpoint = f16_checkpoint(family, taught=kind != "f16")
    with caplog.at_level(logging.INFO, logger="paged_server.models.gguf_tensors"):
        loaded = load_model(converted(converter, checkpoint, kind, tmp_path))
    if kind != "f16":  # the embeddings and LM head stay dense, and the log says so
        assert "dequantized to dense weights" in caplog.text and "token_embd.weight" in caplog.text
        assert any(isinstance(m, QuantizedLinear) for m in loaded.model.modules())
    theirs = Tokenizer.from_dir(checkpoint)
    assert [loaded.tokenizer.encode(t) for t in TEXTS] == [theirs.encode(t) for t in TEXTS]
    assert loaded.chat_template == CHAT_TEMPLATE
    same_greedy_tokens(kind, loaded, load_model(checkpoint))
