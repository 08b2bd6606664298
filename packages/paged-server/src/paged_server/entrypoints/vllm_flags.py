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

# Unknown vLLM flags: what to do here instead.
FLAG_HINTS = {
    "--distributed-executor-backend": "tensor and pipeline parallelism always run one process per device",
    "--swap-space": "no CPU swap: preempted requests are recomputed; drop the flag",
    "--preemption-mode": "preemption always recomputes; drop the flag",
    "--cpu-offload-gb": "weights are not offloaded; lower --dtype or use --quantization",
    "--kv-cache-memory": "use --kv-cache-memory-bytes",
    "--max-num-partial-prefills": "chunked prefill shares one token budget: --max-num-batched-tokens",
    "--scheduling-policy": "scheduling is first come, first served; drop the flag",
    "--disable-async-output-proc": "output processing overlaps the next forward pass only with "
    "--async-output-proc (off by default); drop the flag",
    "--async-scheduling": "steps are scheduled one after another; --async-output-proc "
    "overlaps each step's text and outputs with the next forward pass",
    "--tokenizer-mode": "the checkpoint's tokenizer.json (fast tokenizer) is always used",
    "--hf-overrides": "edit the checkpoint's config.json instead",
    "--max-seq-len-to-capture": "decode steps of any length replay CUDA graphs; see --enforce-eager",
    "--compilation-config": "no torch.compile; CUDA graphs for decode unless --enforce-eager",
    "-O": "no torch.compile; CUDA graphs for decode unless --enforce-eager",
    "--enable-lora": "LoRA adapters are not supported",
    "--lora-modules": "LoRA adapters are not supported",
    "--max-lora-rank": "LoRA adapters are not supported",
    "--speculative-config": "speculative decoding is not supported",
    "--kv-transfer-config": "disaggregated prefill is not supported",
    "--guided-decoding-backend": "structured outputs always use llguidance; drop the flag",
    "--structured-outputs-config": "structured outputs always use llguidance; drop the flag",
    "--limit-mm-per-prompt": "text-only models: no multimodal inputs",
    "--mm-processor-kwargs": "text-only models: no multimodal inputs",
    "--chat-template-content-format": "message content is text (string or text parts)",
    "--enable-prompt-tokens-details": "always on: usage.prompt_tokens_details.cached_tokens",
    "--enable-force-include-usage": "send stream_options.include_usage per request",
    "--return-tokens-as-token-ids": "not supported; logprobs carry token text and bytes",
    "--disable-frontend-multiprocessing": "the API and the engine share one process "
    "(the engine steps on its own thread); drop the flag",
    "--api-server-count": "one API server process; drop the flag",
    "--enable-server-load-tracking": "GET /load is always served; drop the flag",
    "--disable-fastapi-docs": "not supported; /docs is served",
    "--logits-processor-pattern": "per-request logits_processors are not supported",
    "--config": "no YAML config file; pass the flags",
    "--task": "generation only (no embedding, scoring or classification)",
    "--runner": "generation only (no embedding, scoring or classification)",
    "--max-log-len": "request logs (--enable-log-requests) print lengths, not prompts",
}


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
