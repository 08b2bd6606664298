"""`serve` flags of the HTTP side (vLLM's frontend arguments), and the
``ServerSettings`` they make. The engine's flags come from ``EngineConfig``
(``engine_args.py``); these shape the API around it, with vLLM's names."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from paged_server.entrypoints.openai.reasoning import REASONING_PARSERS
from paged_server.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS


def _json_list(text: str) -> list[str]:
    """vLLM's list flags take JSON (``'["*"]'``); a comma list works too."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return [v.strip() for v in text.split(",") if v.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}")
    return value


def _lora_module(text: str) -> dict[str, Any]:
    """vLLM's ``--lora-modules`` entry: ``name=path``, or JSON
    ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not valid JSON: {text!r} ({exc})") from None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(
            value.get("path"), str
        ):
            raise argparse.ArgumentTypeError(
                f'a JSON entry needs "name" and "path" strings, got {text!r}'
            )
        extra = set(value) - {"name", "path", "base_model_name"}
        if extra:
            raise argparse.ArgumentTypeError(f"unknown keys {sorted(extra)} in {text!r}; "
                                             'use "name", "path", "base_model_name"')  # fmt: skip
        return value
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(
            f"expected name=path or a JSON object, got {text!r} (e.g. --lora-modules sql=/adapters/sql)"
        )
    return {"name": name, "path": path}


def lora_requests(modules: list[dict[str, Any]] | None) -> tuple[Any, ...]:
    """``--lora-modules`` as ``LoRARequest``s, numbered from 1 in order."""
    from paged_server.lora_request import LoRARequest

    return tuple(
        LoRARequest(m["name"], i, m["path"], m.get("base_model_name"))
        for i, m in enumerate(modules or [], 1)
    )


def add_frontend_flags(p: argparse.ArgumentParser) -> None:
    """Add the HTTP-side flags (dest = the ``ServerSettings`` field or a name
    ``settings_from_args`` reads)."""
    g = p.add_argument_group("API (vLLM's frontend flags)")
    g.add_argument("--tool-call-parser", choices=list(TOOL_CALL_PARSERS), default=None,
                   help="tool-call format of the model (default: detected from its chat template)")
    g.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
                   help='let the model decide to call tools (tool_choice "auto"); '
                   'off: "auto" is a 400 as in vLLM without the flag')
    g.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=None,
                   help="split the model's <think>...</think> into reasoning_content")
    g.add_argument("--chat-template", default=None,
                   help="chat template (a file, or the Jinja text itself) instead of the tokenizer's")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template sent with a request (default: refused with a 400, "
                   "as vLLM; a template is code the server runs)")
    g.add_argument("--response-role", default="assistant",
                   help="role of the generated chat message")
    g.add_argument("--enable-log-requests", dest="log_requests", action="store_true", default=False,
                   help="log one line per request (id, prompt length, sampling parameters)")
    g.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                   help="no per-request log lines (the default; vLLM's older flag)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (throughput, running/waiting, KV usage, prefix hits)")
    g.add_argument("--metrics-need-api-key", action="store_true",
                   help="with --api-key, /metrics needs the key too (default: open, as vLLM)")
    g.add_argument("--allowed-origins", type=_json_list, default=None, metavar="JSON",
                   help='CORS: origins allowed to call the API from a browser, e.g. \'["*"]\' '
                   "(default: no CORS headers, unlike vLLM's allow-all)")
    g.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                   help="CORS: allowed methods (with --allowed-origins)")
    g.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                   help="CORS: allowed headers (with --allowed-origins)")
    g.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (with --allowed-origins)")
    g.add_argument("--root-path", default="",
                   help="path prefix a reverse proxy strips before forwarding (ASGI root_path)")
    g.add_argument("--disable-web-ui", "--no-webui", dest="disable_web_ui", action="store_true",
                   help="no chat page at / (--no-webui: llama.cpp's name)")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify clients with")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM launch lines; paged runs no code from checkpoints")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprob tokens as 'token_id:N' strings unless a request's "
                   "return_tokens_as_token_ids says otherwise (vLLM's server-wide default)")
    g.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None,
                   metavar="NAME=PATH|JSON",
                   help="LoRA adapters to serve from the start (with --enable-lora): name=path or "
                   '\'{"name": "sql", "path": "/adapters/sql", "base_model_name": "base"}\'; '
                   "a request names one as its model")
    # vLLM flags whose behaviour is always on here: accepted so launch lines start.
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="accepted; usage.prompt_tokens_details.cached_tokens is always reported")
    g.add_argument("--enable-server-load-tracking", action="store_true",
                   help="accepted; GET /load (requests in flight) is always served")


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the value itself when it is a
    Jinja template (vLLM takes both)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{" in value:
        return value
    raise ValueError(f"chat_template: {value} is neither a file nor a Jinja template")


# ServerSettings fields that take their flag's value under the flag's own name.
_SETTINGS_AS_FLAGS = (
    "max_body_bytes",
    "tool_call_parser",
    "enable_auto_tool_choice",
    "reasoning_parser",
    "trust_request_chat_template",
    "response_role",
    "return_tokens_as_token_ids",
    "log_requests",
    "metrics_need_api_key",
    "allowed_origins",
    "allowed_methods",
    "allowed_headers",
    "allow_credentials",
    "root_path",
    "ssl_keyfile",
    "ssl_certfile",
    "ssl_ca_certs",
)


def settings_from_args(args: argparse.Namespace, model_name: str, api_key: str | None) -> Any:
    """The ``ServerSettings`` of parsed ``serve`` flags."""
    from paged_server.entrypoints.openai.app import ServerSettings

    if args.ssl_keyfile and not args.ssl_certfile or args.ssl_certfile and not args.ssl_keyfile:
        raise ValueError("ssl: pass both --ssl-keyfile and --ssl-certfile")
    return ServerSettings(
        model_name=model_name,
        api_key=api_key,
        announce=True,
        shutdown_timeout_s=args.shutdown_timeout,
        audit_interval_s=args.audit_interval,
        request_read_timeout_s=args.request_read_timeout,
        timeout_keep_alive_s=args.timeout_keep_alive,
        chat_template=read_chat_template(args.chat_template),
        log_stats=not args.disable_log_stats,
        enable_web_ui=not args.disable_web_ui,
        **{name: getattr(args, name) for name in _SETTINGS_AS_FLAGS},
    )
