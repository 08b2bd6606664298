"""`vllm serve` flags this server has no such flag for: what to use instead.

A launch line copied from vLLM's docs should either start or fail on its
first flag with one line that says what this server does instead. Flags that
exist here under vLLM's name (or as an alias, see ``engine_args._ALIASES``)
never reach this table; it covers the rest: refused download flags and
features this server does not have.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any

_NO_DOWNLOAD = (
    "paged-server downloads nothing: pass a local checkpoint directory (or a Hugging Face id "
    "already in the local HF cache, e.g. after `huggingface-cli download`)"
)

# vLLM flags that name a download; refused with this reason (the value is never used).
REFUSED_FLAGS = {
    "--revision": _NO_DOWNLOAD,
    "--code-revision": _NO_DOWNLOAD,
    "--tokenizer-revision": _NO_DOWNLOAD,
    "--download-dir": _NO_DOWNLOAD,
    "--hf-token": _NO_DOWNLOAD,
}
# --load-format values that mean "read the checkpoint's safetensors", which is all we do.
LOAD_FORMATS = ("auto", "safetensors")

_TEXT_ONLY = "text-only models: no multimodal inputs; drop the flag"
_LORA_DTYPE = "adapters run in the model's dtype (--dtype); drop the flag"
_NO_MOE_PARALLEL = "no expert parallelism: MoE layers run tensor parallel (-tp); drop the flag"
_NO_DP_CLUSTER = ("data-parallel replicas are started by one serve command on one machine "
                  "(--data-parallel-size); drop the flag")
_NO_PLUGINS = "this server loads no plugins or custom classes; drop the flag"
_NO_MAMBA = "no Mamba/SSM models: the KV cache holds attention layers only; drop the flag"
_CUDA_GRAPHS = "decode steps of any batch size replay CUDA graphs; see --enforce-eager"
_NO_TRACING = "no OpenTelemetry tracing: /metrics (Prometheus) and --enable-log-requests; drop the flag"
_LOCAL_FILES = "weights load from the checkpoint's *.safetensors files as they are; drop the flag"
_UVICORN = "the HTTP server runs uvicorn's defaults for this; drop the flag"

# Unknown vLLM flags: what to do here instead.
FLAG_HINTS = {
    "--distributed-executor-backend": "tensor and pipeline parallelism always run one process per device",
    "--swap-space": "no CPU swap: preempted requests are recomputed; drop the flag",
    "--kv-offloading-backend": "KV blocks are offloaded by this server's own tiers "
    "(--kv-offloading-size GiB, --kv-disk-dir DIR); drop the flag",
    "--enable-sleep-mode": "no sleep mode (/sleep, /wake_up): the weights and KV pool stay "
    "allocated while the server runs; drop the flag",
    "--preemption-mode": "preemption always recomputes; drop the flag",
    "--cpu-offload-gb": "weights are not offloaded; lower --dtype or use --quantization",
    "--kv-cache-memory": "use --kv-cache-memory-bytes",
    "--max-num-partial-prefills": "chunked prefill shares one token budget: --max-num-batched-tokens",
    "--disable-async-output-proc": "output processing overlaps the next forward pass only with "
    "--async-output-proc (off by default); drop the flag",
    "--tokenizer-mode": "the checkpoint's tokenizer.json (fast tokenizer) is always used",
    "--hf-overrides": "edit the checkpoint's config.json instead",
    "--max-seq-len-to-capture": "decode steps of any length replay CUDA graphs; see --enforce-eager",
    "--compilation-config": "no torch.compile; CUDA graphs for decode unless --enforce-eager",
    "-O": "no torch.compile; CUDA graphs for decode unless --enforce-eager",
    "--kv-transfer-config": "disaggregated prefill is not supported",
    "--guided-decoding-backend": "structured outputs always use llguidance; drop the flag",
    "--structured-outputs-config": "structured outputs always use llguidance; drop the flag",
    "--limit-mm-per-prompt": "text-only models: no multimodal inputs",
    "--mm-processor-kwargs": "text-only models: no multimodal inputs",
    "--chat-template-content-format": "message content is text (string or text parts)",
    "--enable-force-include-usage": "send stream_options.include_usage per request",
    "--disable-frontend-multiprocessing": "the API and the engine share one process "
    "(the engine steps on its own thread); drop the flag",
    "--api-server-count": "one API server process; drop the flag",
    "--disable-fastapi-docs": "not supported; /docs is served",
    "--logits-processor-pattern": "per-request logits_processors are not supported",
    "--config": "no YAML config file; pass the flags",
    "--max-log-len": "request logs (--enable-log-requests) print lengths, not prompts",
    # serve and frontend flags
    "--headless": "one process serves the API and the engine; multi-node runs use "
    "`paged-server worker` on the other nodes",
    "--uds": "serve on TCP (--host, --port); a Unix socket is not supported",
    "--disable-uvicorn-access-log": "the access log follows --uvicorn-log-level (warning drops it)",
    "--enable-ssl-refresh": "certificates are read once at start-up; restart to renew them",
    "--ssl-cert-reqs": "with --ssl-ca-certs clients are verified; other modes are not supported",
    "--middleware": _NO_PLUGINS,
    "--enable-request-id-headers": "the response id carries the request_id field; no X-Request-Id header",
    "--exclude-tools-when-tool-choice-none": "tools are always left out of the prompt when "
    "tool_choice is none; drop the flag",
    "--tool-parser-plugin": "tool calls use --tool-call-parser's built-in formats; " + _NO_PLUGINS,
    "--tool-server": "built-in tools (browser, python) are not supported; clients run their "
    "own function tools",
    "--log-config-file": "logs go to stderr at --uvicorn-log-level; drop the flag",
    "--enable-tokenizer-info-endpoint": "no /get_tokenizer_info; /tokenize and /detokenize are served",
    "--enable-log-outputs": "request logs (--enable-log-requests) print lengths, not text",
    "--h11-max-incomplete-event-size": "uvicorn's h11 limits apply to headers; request bodies "
    "are bounded by --max-body-bytes",
    "--h11-max-header-count": _UVICORN,
    "--log-error-stack": "unexpected errors are always logged with their stack",
    "--tokens-only": "all endpoints are served; drop the flag",
    # ModelConfig
    "--hf-config-path": "config.json is read from the model directory",
    "--allowed-local-media-path": _TEXT_ONLY,
    "--allowed-media-domains": _TEXT_ONLY,
    "--rope-scaling": "rope scaling comes from config.json; edit it there",
    "--rope-theta": "rope_theta comes from config.json; edit it there",
    "--logprobs-mode": "logprobs are the model's raw log-softmax (vLLM's raw_logprobs); drop the flag",
    "--disable-cascade-attn": "there is no cascade attention; drop the flag",
    "--skip-tokenizer-init": "the tokenizer is always loaded: the API takes and returns text",
    "--enable-prompt-embeds": "prompts are text or token ids; prompt_embeds are not supported",
    "--config-format": "config.json (Hugging Face format) is always read",
    "--model-impl": "one implementation per family (paged_server/models/); drop the flag",
    "--override-attention-dtype": "attention runs in --dtype; see --kv-cache-dtype for the cache",
    "--logits-processors": "custom logits processors are not supported",
    "--io-processor-plugin": _NO_PLUGINS,
    # LoadConfig
    "--safetensors-load-strategy": _LOCAL_FILES,
    "--model-loader-extra-config": _LOCAL_FILES,
    "--ignore-patterns": "only *.safetensors, config and tokenizer files are read; drop the flag",
    "--use-tqdm-on-load": "loading logs one line; drop the flag",
    "--pt-load-map-location": "only safetensors checkpoints load; drop the flag",
    # StructuredOutputsConfig
    "--guided-decoding-disable-fallback": "structured outputs always use llguidance; drop the flag",
    "--guided-decoding-disable-any-whitespace": "structured outputs always use llguidance; drop the flag",
    "--guided-decoding-disable-additional-properties": "structured outputs always use llguidance; "
    "drop the flag",
    # ParallelConfig
    "--decode-context-parallel-size": "no context parallelism; use -tp or -pp",
    "--data-parallel-rank": _NO_DP_CLUSTER,
    "--data-parallel-start-rank": _NO_DP_CLUSTER,
    "--data-parallel-size-local": _NO_DP_CLUSTER,
    "--data-parallel-address": _NO_DP_CLUSTER,
    "--data-parallel-rpc-port": _NO_DP_CLUSTER,
    "--data-parallel-backend": _NO_DP_CLUSTER,
    "--data-parallel-hybrid-lb": _NO_DP_CLUSTER,
    "--enable-expert-parallel": _NO_MOE_PARALLEL,
    "--all2all-backend": _NO_MOE_PARALLEL,
    "--enable-eplb": _NO_MOE_PARALLEL,
    "--eplb-config": _NO_MOE_PARALLEL,
    "--expert-placement-strategy": _NO_MOE_PARALLEL,
    "--num-redundant-experts": _NO_MOE_PARALLEL,
    "--eplb-window-size": _NO_MOE_PARALLEL,
    "--eplb-step-interval": _NO_MOE_PARALLEL,
    "--eplb-log-balancedness": _NO_MOE_PARALLEL,
    "--enable-dbo": "no dual-batch overlap: one batch per step; drop the flag",
    "--dbo-decode-token-threshold": "no dual-batch overlap: one batch per step; drop the flag",
    "--dbo-prefill-token-threshold": "no dual-batch overlap: one batch per step; drop the flag",
    "--disable-nccl-for-dp-synchronization": "data-parallel engines do not synchronise; drop the flag",
    "--max-parallel-loading-workers": "each rank loads its own shard; drop the flag",
    "--ray-workers-use-nsight": "no Ray: one process per device; drop the flag",
    "--disable-custom-all-reduce": "all-reduce always uses torch.distributed; drop the flag",
    "--worker-cls": _NO_PLUGINS,
    "--worker-extension-cls": _NO_PLUGINS,
    "--enable-multimodal-encoder-data-parallel": _TEXT_ONLY,
    # CacheConfig
    "--prefix-caching-hash-algo": "prefix-cache hits compare token ids, not hashes; drop the flag",
    "--kv-sharing-fast-prefill": "no cross-layer KV sharing; drop the flag",
    "--mamba-cache-dtype": _NO_MAMBA,
    "--mamba-ssm-cache-dtype": _NO_MAMBA,
    "--mamba-block-size": _NO_MAMBA,
    # MultiModalConfig
    "--enable-mm-embeds": _TEXT_ONLY,
    "--media-io-kwargs": _TEXT_ONLY,
    "--mm-processor-cache-gb": _TEXT_ONLY,
    "--disable-mm-preprocessor-cache": _TEXT_ONLY,
    "--mm-processor-cache-type": _TEXT_ONLY,
    "--mm-shm-cache-max-object-size-mb": _TEXT_ONLY,
    "--mm-encoder-tp-mode": _TEXT_ONLY,
    "--mm-encoder-attn-backend": _TEXT_ONLY,
    "--interleave-mm-strings": _TEXT_ONLY,
    "--skip-mm-profiling": _TEXT_ONLY,
    "--video-pruning-rate": _TEXT_ONLY,
    # LoRAConfig
    "--lora-extra-vocab-size": "adapters with extra vocabulary (embedding or LM-head adapters) "
    "are not supported; drop the flag",
    "--lora-dtype": _LORA_DTYPE,
    "--fully-sharded-loras": "each tensor-parallel rank holds its shard of every adapter "
    "(B of column-parallel layers, A of row-parallel ones); drop the flag",
    "--default-mm-loras": _TEXT_ONLY,
    # ObservabilityConfig
    "--show-hidden-metrics-for-version": "no metrics are hidden; drop the flag",
    "--otlp-traces-endpoint": _NO_TRACING,
    "--collect-detailed-traces": _NO_TRACING,
    # SchedulerConfig
    "--max-long-partial-prefills": "chunked prefill shares one token budget: --max-num-batched-tokens",
    "--num-lookahead-slots": "lookahead slots follow --speculative-config's num_speculative_tokens; drop the flag",
    "--disable-chunked-mm-input": _TEXT_ONLY,
    "--scheduler-cls": _NO_PLUGINS,
    # CompilationConfig, VllmConfig, other
    "--cudagraph-capture-sizes": _CUDA_GRAPHS,
    "--cuda-graph-sizes": _CUDA_GRAPHS,
    "--max-cudagraph-capture-size": _CUDA_GRAPHS,
    "--kv-events-config": "no KV cache events are published; /metrics reports the pool",
    "--additional-config": _NO_PLUGINS,
    "--aggregate-engine-logging": "one stats line reports the whole server; drop the flag",
}
# vLLM's short forms of flags this server has no such flag for.
for _short, _long in {"-asc": "--api-server-count", "-dcp": "--decode-context-parallel-size",
                      "-dpn": "--data-parallel-rank", "-dpr": "--data-parallel-start-rank",
                      "-dpl": "--data-parallel-size-local", "-dpa": "--data-parallel-address",
                      "-dpp": "--data-parallel-rpc-port", "-dpb": "--data-parallel-backend"}.items():
    FLAG_HINTS[_short] = f"({_long}) {FLAG_HINTS[_long]}"


class HintingParser(argparse.ArgumentParser):
    """An ArgumentParser whose "unrecognized arguments" error says, for each
    unknown flag, what to use here instead (``FLAG_HINTS``) or the closest
    flag it has."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            message += "".join(
                f"\n  {flag}: {hint}" for flag, hint in self._hints(message[len(prefix):].split())
            )
        super().error(message)

    def _hints(self, words: list[str]) -> list[tuple[str, str]]:
        known = _known_flags(self)
        hints = []
        for word in words:
            flag = word.split("=", 1)[0]
            if not flag.startswith("-"):
                continue
            if flag in FLAG_HINTS:
                hints.append((flag, FLAG_HINTS[flag]))
                continue
            close = difflib.get_close_matches(flag, known + list(FLAG_HINTS), n=1, cutoff=0.75)
            if close and close[0] in FLAG_HINTS:  # a misspelt vLLM flag we have no match for
                hints.append((flag, f"(as {close[0]}) {FLAG_HINTS[close[0]]}"))
            elif close:
                hints.append((flag, f"did you mean {close[0]}?"))
        return hints


def _known_flags(parser: argparse.ArgumentParser) -> list[str]:
    flags = [s for a in parser._actions for s in a.option_strings]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags += _known_flags(sub)
    return flags


class _Refuse(argparse.Action):
    """A vLLM flag this server refuses (``REFUSED_FLAGS``), with its reason."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string}: {REFUSED_FLAGS[option_string or '']}")


def _load_format(text: str) -> str:
    if text not in LOAD_FORMATS:
        raise argparse.ArgumentTypeError(
            f"only {' or '.join(LOAD_FORMATS)} (the checkpoint's *.safetensors files) is "
            f"supported, got {text!r}; convert the checkpoint to safetensors"
        )
    return text


def add_refused_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's download flags, refused with a reason, and ``--load-format``
    (``auto``/``safetensors`` only)."""
    group = parser.add_argument_group("vLLM flags refused here (nothing is downloaded)")
    for flag in REFUSED_FLAGS:
        group.add_argument(flag, action=_Refuse, metavar="X", help=argparse.SUPPRESS)
    group.add_argument("--load-format", type=_load_format, default="auto",
                       help="checkpoint format: safetensors only (auto = safetensors)")
