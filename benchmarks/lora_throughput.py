"""Multi-LoRA throughput: 16 streams over 8 adapters against the base model.

    python benchmarks/lora_throughput.py [--streams 16 --adapters 8 --rank 16 --repeats 3]
                                         [--hidden 1024 --layers 4]

The embedded default model (hidden 256: rank-16 adapters are the largest
share of its projections' work, and their fixed per-projection cost the
largest share of a step), or with ``--hidden`` a
random Llama of that width (its tokenizer), greedy, the same prompts in
every run (issue 57's targets):

- ``base``: an engine without ``--enable-lora``, every stream on the base model;
- ``lora_enabled_unused``: an engine with ``--enable-lora`` (``--max-loras``
  = ``--adapters``, every adapter loaded), every stream on the base model:
  what the adapter-free path pays for the slot tables (target: nothing);
- ``lora``: the same engine, stream ``i`` on adapter ``i % adapters``
  (random rank-``--rank`` adapters on every projection, written here in
  PEFT's format): target >= 0.8x ``base``'s tokens/s.

Each run submits every stream at once and steps until all finish; tokens/s
counts prompt and generated tokens; each figure is the median of
``--repeats`` runs (one warm-up run first), the three configurations taking
turns so that a shared machine's load falls on each alike. With ``--enforce-eager`` every
engine runs eagerly (on a CPU the default compiles the forward pass, which
steps with adapters leave: docs/models.md). Writes
benchmarks/results/lora_throughput.json (``_h<hidden>.json`` with ``--hidden``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from paged_server.default_model import ensure_default_model
from paged_server.entrypoints.llm import LLM
from paged_server.lora_request import LoRARequest
from paged_server.models.loader import read_model_config
from paged_server.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "lora_throughput.json"
PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(path: Path, config: Any, rank: int, seed: int) -> None:
    """A random LoRA adapter on every projection, in PEFT's files."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip
    tensors = {}
    for layer in range(config.num_layers):
        for block, names in PROJECTIONS.items():
            for name in names:
                fan_in, fan_out = shapes[name]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [n for names in PROJECTIONS.values() for n in names],
    }))  # fmt: skip


def random_llama(path: Path, hidden: int, layers: int) -> Path:
    """A random Llama of width ``hidden`` (head dim 64, 4:1 GQA, MLP 2.75x), the embedded tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    default = ensure_default_model()
    torch.manual_seed(0)
    heads = hidden // 64
    config = LlamaConfig(vocab_size=read_model_config(default).vocab_size, hidden_size=hidden,
                         intermediate_size=int(hidden * 2.75) // 64 * 64, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                         max_position_embeddings=2048, tie_word_embeddings=True)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((default / name).read_bytes())
    return path


def run(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None], max_tokens: int) -> dict[str, Any]:
    """Every stream at once, stepped to the end: tokens/s and the tokens."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"s{i}", prompt, params, lora_request=lora)
        tokens[f"s{i}"] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    seconds = time.perf_counter() - start
    total = sum(map(len, prompts)) + sum(map(len, tokens.values()))
    return {"tokens_per_s": total / seconds, "seconds": seconds, "tokens": [tokens[f"s{i}"] for i in range(len(prompts))]}


def measure(runs: dict[str, tuple[LLM, list[LoRARequest | None]]], prompts: list[list[int]],
            args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each configuration once to warm up, then ``repeats`` rounds taking
    turns, so a shared machine's load falls on all of them alike."""
    for llm, loras in runs.values():
        run(llm, prompts, loras, args.max_tokens)  # warm-up (and adapters into their slots)
    out: dict[str, dict[str, Any]] = {name: {"runs": []} for name in runs}
    for _ in range(args.repeats):
        for name, (llm, loras) in runs.items():
            result = run(llm, prompts, loras, args.max_tokens)
            out[name]["runs"].append(result["tokens_per_s"])
            out[name]["tokens"] = result["tokens"]
    for result in out.values():
        result["tokens_per_s"] = statistics.median(result["runs"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--hidden", type=int, default=None, help="a random Llama of this width instead")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    scratch = tempfile.TemporaryDirectory()
    model = random_llama(Path(scratch.name) / "model", args.hidden, args.layers) if args.hidden else ensure_default_model()
    config = read_model_config(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, config.vocab_size) for _ in range(args.prompt_tokens)] for _ in range(args.streams)]
    engine_args: dict[str, Any] = dict(device="cpu", max_batch_size=args.streams, enforce_eager=args.enforce_eager)
    results: dict[str, Any] = {"streams": args.streams, "adapters": args.adapters, "rank": args.rank,
                               "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                               "enforce_eager": args.enforce_eager, "torch_threads": torch.get_num_threads(),
                               "hidden_size": config.hidden_size, "layers": config.num_layers}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        loras = []
        for i in range(args.adapters):
            write_adapter(Path(tmp) / f"a{i}", config, args.rank, i)
            loras.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        base_llm = LLM(str(model), **engine_args)
        llm = LLM(str(model), enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, **engine_args)
        for lora in loras:
            llm.engine.add_lora(lora)
        none: list[LoRARequest | None] = [None] * args.streams
        got = measure({"base": (base_llm, none), "lora_enabled_unused": (llm, none),
                       "lora": (llm, [loras[i % args.adapters] for i in range(args.streams)])}, prompts, args)  # fmt: skip
    for name, result in got.items():
        results[name] = {"tokens_per_s": result["tokens_per_s"], "runs": result["runs"]}
    base, unused, lora = got["base"], got["lora_enabled_unused"], got["lora"]
    results["lora_vs_base"] = lora["tokens_per_s"] / base["tokens_per_s"]
    results["unused_vs_base"] = unused["tokens_per_s"] / base["tokens_per_s"]
    results["same_tokens_unused"] = unused["tokens"] == base["tokens"]
    results["adapters_changed_tokens"] = sum(a != b for a, b in zip(lora["tokens"], base["tokens"], strict=True))
    scratch.cleanup()
    out = RESULTS if not args.hidden else RESULTS.with_name(f"lora_throughput_h{args.hidden}.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
