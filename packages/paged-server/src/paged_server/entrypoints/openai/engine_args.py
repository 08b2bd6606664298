"""Command-line flags generated from ``EngineConfig``'s fields, so they never drift.

Every field ``foo_bar: T = default`` becomes ``--foo-bar``: booleans get
``--foo-bar/--no-foo-bar``, ``int | None`` fields take an integer (or
``none``), the rest take a value of the field's type. The help text is the
field's ``metadata["help"]`` when it has one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any

from paged_server import config as config_module
from paged_server.config import EngineConfig

_NONE_WORDS = {"none", "null", "auto-none"}


def _parse_optional(inner: type) -> Any:
    def parse(text: str) -> Any:
        if text.lower() in _NONE_WORDS:
            return None
        return inner(text)

    parse.__name__ = inner.__name__  # argparse names the type in its error messages
    return parse


def _field_kind(hint: Any) -> tuple[type, bool]:
    """(base type, optional) for ``int``, ``int | None``, ``str | None``..."""
    args = typing.get_args(hint)
    is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    if is_union and type(None) in args:
        others = [a for a in args if a is not type(None)]
        return others[0], True
    return hint, False


# What each field means to an operator. A field missing here still gets its
# flag (help: its name); the flag set itself always follows the dataclass.
_HELP = {
    "model": "Hugging Face model directory (config.json, *.safetensors, tokenizer.json); "
    "omitted: the embedded tiny default model",
    "kv_cache_backend": "KV cache layout: paged blocks or one contiguous max_model_len row per sequence",
    "block_size": "tokens per KV block",
    "num_gpu_blocks": "KV blocks in the pool (none: from --kv-cache-memory-bytes, else "
    "max_batch_size * max_model_len / block_size)",
    "kv_cache_memory_bytes": "KV cache memory budget in bytes (sizes the pool)",
    "gpu_memory_utilization": "share of device memory this server may use; the KV pool gets "
    "what weights and a profiling step leave (default 0.9 on CUDA; on CPU, when set: that "
    "share of the available RAM)",
    "max_batch_size": "most sequences running at once",
    "max_num_batched_tokens": "token budget of one engine step (decode + prefill chunks); "
    "none: 2048 on CUDA, 256 on CPU (where a step costs in proportion to its tokens)",
    "max_model_len": "most tokens per sequence, prompt + generated",
    "enable_prefix_caching": "reuse KV blocks of identical prompt prefixes",
    "disable_hybrid_kv_cache_manager": "one page table for all layers even when some use a "
    "sliding window (otherwise sliding-window layers get their own KV cache groups and give "
    "back blocks that leave the window)",
    "enable_chunked_prefill": "split long prompts into chunks interleaved with decode",
    "long_prefill_token_threshold": "with chunked prefill, at most this many of one prompt's "
    "tokens per step (0: off): shorter steps while prompts arrive, so steadier streaming, "
    "at the cost of later first tokens for long prompts",
    "attention_backend": "attention kernels: auto = triton on CUDA, ref on CPU; cpu = the C kernels",
    "enforce_eager": "run every step eagerly; otherwise, on CPU the forward pass is compiled "
    "(torch.compile) at start-up, and on CUDA with the triton backend decode steps replay "
    "CUDA graphs captured at start-up",
    "async_output_proc": "make each step's text and outputs while the next forward pass runs "
    "(on a GPU the pass is asynchronous, so the host work overlaps it); outputs then arrive "
    "one step later, and a stop string is found one token late (that token is dropped). "
    "Helps large batches on CUDA; no gain on CPU, where the pass holds the cores",
    "async_scheduling": "plan each step and make the last step's outputs (sampling's "
    "bookkeeping, text, stop strings) while the forward pass runs, as vLLM's "
    "--async-scheduling; the pass runs on a thread of its own. Default: on with CUDA, off on "
    "CPU (where the pass holds the cores and the GIL); --no-async-scheduling turns it off",
    "speculative_config": 'speculative decoding, as vLLM\'s JSON: {"method": "ngram", '
    '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}: drafts copied '
    "from the request's own prompt and output, all checked in one forward pass (greedy output "
    "is unchanged, sampled output keeps the model's distribution); or a draft model with the "
    'target\'s tokenizer: {"model": DIR, "num_speculative_tokens": 4}; disable_by_batch_size: stop '
    "speculating from that many running sequences",
    "dtype": "weights dtype: auto = bfloat16 on CUDA, float32 on CPU",
    "kv_cache_dtype": "what the KV cache stores: auto = the model dtype; fp8 (= fp8_e4m3) and "
    "fp8_e5m2 with a per-tensor scale of 1.0; int8 with a scale per token and kv head. "
    "8 bits hold ~2x the tokens of 16 in the same --kv-cache-memory-bytes",
    "calculate_kv_scales": "with an 8-bit --kv-cache-dtype: static K/V scales per layer and kv "
    "head from one calibration pass at start-up (int8: no per-token scales, exactly 2x the "
    "tokens of 16 bits; fp8: its full range instead of a scale of 1). Values beyond the "
    "calibration text's range saturate",
    "device": "auto, cpu, cuda or cuda:N",
    "max_queue_len": "waiting requests beyond which new ones get HTTP 503",
    "scheduling_policy": "fcfs: requests run in arrival order (a request's priority must be "
    "0); priority: by each request's priority field (lower first, arrival order among "
    "equals), and a waiting request that finds no room preempts running ones of a lower "
    "priority (higher value), which are recomputed later",
    "seed": "engine seed for sampling without a per-request seed",
    "quantization": "weight format: none = the checkpoint's own (a compressed-tensors, gptq or "
    "awq quantization_config is detected); fp8, int8 (per channel) or int4 (groups of 128) "
    "quantize 16/32-bit weights at load; int8/int4 run torch's packed weight-only kernels on CPU",
    "max_logprobs": "most logprobs / prompt_logprobs alternatives a request may ask for "
    "(-1: no limit, and a request's logprobs -1 means the whole vocabulary)",
    "tokenizer": "tokenizer directory (tokenizer.json, chat template), when not the model's",
    "generation_config": "sampling defaults for requests that leave a field unset: auto = the "
    "model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
    "max_new_tokens); vllm = none (temperature 1.0, as the API's defaults); or a directory "
    "holding a generation_config.json",
    "override_generation_config": 'JSON object of sampling defaults on top of --generation-config, '
    'e.g. \'{"temperature": 0.5}\'',
    "disable_sliding_window": "run sliding-window layers with full attention; max_model_len is "
    "then capped at the window (as vLLM)",
    "runner": "auto: generate, or pooling for a checkpoint saved as *Model / "
    "*ForSequenceClassification; pooling: serve /v1/embeddings, /pooling, /classify, /score, "
    "/rerank instead of generation (vLLM's --runner)",
    "convert": "the pooling head with --runner pooling: embed (final-norm states pooled as the "
    "checkpoint's sentence-transformers config says, else last token, normalized) or classify "
    "(the checkpoint's score head); auto: the checkpoint's own, else embed",
    "task": "vLLM's older spelling of --runner/--convert: embed, classify, score (pooling) or generate",
    "pooler_config": 'JSON over the checkpoint\'s pooling, e.g. \'{"pooling_type": "MEAN", '
    '"normalize": false}\' (pooling_type LAST, MEAN or CLS)',
    "tensor_parallel_size": "shard the model over this many devices (one process each; "
    "NCCL on CUDA, gloo on CPU); KV memory budgets are per device",
    "pipeline_parallel_size": "split the layers into this many stages run one after another, "
    "each on tensor_parallel_size devices of its own (one process each); each stage's KV cache "
    "holds only its layers, so a per-device budget holds more tokens",
    "data_parallel_size": "run this many engine replicas, each its own process with its own KV "
    "cache, behind this one API server, which balances requests on load (queue length, KV "
    "usage) and sends requests sharing a prompt prefix to the same replica; each replica has "
    "its own tensor/pipeline ranks; on CUDA replica i gets the i-th GPU (group of "
    "tensor x pipeline GPUs), on CPU the replicas share the cores",
    "enable_lora": "serve LoRA adapters (PEFT format) on the base model: --lora-modules at "
    "start-up, POST /v1/load_lora_adapter at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING=true), "
    "the adapter's name as a request's model",
    "max_loras": "most adapters in one step (device slots); requests of others wait",
    "max_lora_rank": "highest adapter rank served (every slot is padded to it)",
    "max_cpu_loras": "adapters kept read in host memory (none: max_loras); others are read "
    "again from disk when a step needs them",
}


# vLLM's names for fields we name differently (README's table).
_ALIASES = {
    "max_batch_size": ("--max-num-seqs",),
    "num_gpu_blocks": ("--num-gpu-blocks-override",),
    "tensor_parallel_size": ("-tp",),
    "pipeline_parallel_size": ("-pp",),
    "data_parallel_size": ("-dp",),
    "quantization": ("-q",),
    "pooler_config": ("--override-pooler-config",),
}


def _json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object (vLLM's dict-valued flags)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _choices(name: str) -> tuple[str, ...] | None:
    """Allowed values the config module declares for a string field."""
    if name == "kv_cache_backend":
        return tuple(getattr(config_module, "KV_CACHE_BACKENDS", ())) or None
    if name == "attention_backend":
        return tuple(getattr(config_module, "ATTENTION_BACKENDS", ())) or None
    if name == "scheduling_policy":
        return tuple(getattr(config_module, "SCHEDULING_POLICIES", ())) or None
    if name == "kv_cache_dtype":
        return tuple(getattr(config_module, "KV_CACHE_DTYPES", ())) or None
    if name == "quantization":
        from paged_server.models.quantization.methods import QUANTIZATION_METHODS

        return QUANTIZATION_METHODS
    if name in ("runner", "convert", "task"):
        from paged_server.models.pooler import CONVERTS, RUNNERS, TASKS

        return {"runner": RUNNERS, "convert": CONVERTS, "task": tuple(TASKS)}[name]
    if name == "dtype" and hasattr(config_module, "DTYPES"):
        return ("auto", *config_module.DTYPES)
    return None


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Add one flag per ``EngineConfig`` field to ``parser`` (dest = field name)."""
    group = parser.add_argument_group("engine (one flag per EngineConfig field)")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        base, optional = _field_kind(hints[f.name])
        flags = ("--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, ()))
        if flags[0] in parser._option_string_actions:  # the command's own flag, same dest
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f.metadata.get("help") or _HELP.get(f.name, f"EngineConfig.{f.name}")
        if base is bool:
            group.add_argument(
                *flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
            continue
        if typing.get_origin(base) is dict or base is dict:
            group.add_argument(*flags, dest=f.name, type=_json_object, default=default,
                               metavar="JSON", help=help_text)
            continue
        parse = _parse_optional(base) if optional else base
        choices = _choices(f.name)
        metavar = "{" + ",".join(choices) + "}" if choices else base.__name__.upper()
        if f.name == "model":
            metavar = "DIR"
        elif optional and not choices:
            metavar += "|none"
        group.add_argument(
            *flags, dest=f.name, type=parse, default=default, metavar=metavar, help=help_text,
            choices=choices,
        )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` the parsed flags describe (validated)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    config = EngineConfig(**values)
    config.validate()
    return config
