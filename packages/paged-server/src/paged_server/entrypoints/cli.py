"""`paged-server` command line: ``serve``, ``bench-serve``, ``bench``, ``worker``.

``serve`` and ``bench-serve`` take one flag per ``EngineConfig`` field
(generated from the dataclass, see ``openai/engine_args.py``). ``bench`` hands
its arguments to ``paged_server.bench.main`` (the offline engine benchmark).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import socket
import sys
from typing import Any

from paged_server.entrypoints.vllm_flags import HintingParser

API_KEY_ENV = "PAGED_API_KEY"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except ``None`` ones (their help says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def _at_least(kind: type, low: float) -> Any:
    """An argparse type: a ``kind`` number >= ``low`` (finite)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number >= {low:g}, got {text!r}") from None
        if not value >= low or value == math.inf:  # NaN compares False
            raise argparse.ArgumentTypeError(f"must be >= {low:g}, got {text}")
        return value

    return parse


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535 (0 = any free port), got {text}")
    return port


def _add_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from paged_server.entrypoints.openai.engine_args import add_engine_flags
    from paged_server.entrypoints.openai.frontend_args import add_frontend_flags
    from paged_server.entrypoints.openai.middleware import DEFAULT_MAX_BODY_BYTES
    from paged_server.entrypoints.openai.read_timeout import DEFAULT_REQUEST_READ_TIMEOUT_S
    from paged_server.entrypoints.vllm_flags import add_refused_flags

    p = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve /v1/completions, /v1/chat/completions, /v1/responses, /v1/messages, "
        "/v1/models, /health, /metrics. "
        "Takes `vllm serve` launch lines: vLLM's flag names work (see README's table).",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model directory, or a Hugging Face id already in the local HF cache "
                   "(as `vllm serve MODEL`); same as --model")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port (0 = any free port)")
    p.add_argument(
        "--api-key",
        default=None,  # read from the environment at run time, never shown by --help
        help=f"require 'Authorization: Bearer KEY' on every endpoint but /health "
        f"(default: ${API_KEY_ENV} if set, else no key)",
    )
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model id(s) clients send; the first is reported (default: the model "
                   "directory's name, or the Hugging Face id it was named by)")
    p.add_argument("--max-body-bytes", type=_at_least(int, 1), default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get HTTP 413")
    p.add_argument("--shutdown-timeout", type=_at_least(float, 0), default=30.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM before being aborted")
    p.add_argument("--request-read-timeout", type=_at_least(float, 0.001),
                   default=DEFAULT_REQUEST_READ_TIMEOUT_S,
                   help="seconds a client has to send a whole request (head and body) once its "
                   "connection opens or its request starts; slower ones are closed (slowloris)")
    p.add_argument("--timeout-keep-alive", type=_at_least(int, 1), default=5,
                   help="seconds an idle kept-alive connection stays open between requests "
                   "(uvicorn's timeout_keep_alive, as vLLM's default)")
    p.add_argument("--audit-interval", type=_at_least(float, 0), default=60.0,
                   help="seconds between KV block audits while the engine is idle; findings are "
                   "logged and exported as paged:kv_audit_problems (0 = never)")
    p.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="log level of the server and uvicorn (vLLM: --uvicorn-log-level)")
    add_frontend_flags(p)
    add_engine_flags(p)
    add_refused_flags(p)


def _add_bench_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from paged_server.bench.serving import add_bench_serve_flags
    from paged_server.entrypoints.openai.engine_args import add_engine_flags

    p = sub.add_parser(
        "bench-serve",
        help="serving benchmark over HTTP (Poisson arrivals, TTFT/ITL percentiles, one JSON line)",
        description="Starts a server in-process on a free loopback port (engine flags below) "
        "unless --url names a running one.",
        formatter_class=_HelpFormatter,
    )
    add_bench_serve_flags(p)
    add_engine_flags(p)


def _add_worker(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "worker",
        help="run this node's tensor-parallel ranks for an engine on another node",
        description="Joins the engine started with --nnodes N on node 0 (serve or LLM) at "
        "--master-addr:--master-port and runs this node's ranks until the engine stops. Under "
        "torchrun it runs the rank torchrun gives it (RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   help="node 0's address ($MASTER_ADDR when set)")
    p.add_argument("--master-port", type=_port, default=int(os.environ.get("MASTER_PORT", "29500")),
                   help="the engine's rendezvous port ($MASTER_PORT when set)")
    p.add_argument("--nnodes", type=_at_least(int, 2), default=2, help="nodes in all, node 0's included")
    p.add_argument("--node-rank", type=_at_least(int, 1), default=1, help="this node's index (1..nnodes-1)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def _run_worker(args: argparse.Namespace | None) -> int:
    """``worker``, or a non-zero torchrun rank of ``serve``: run ranks until
    the engine stops them."""
    from paged_server.parallel import node_worker, rendezvous

    try:
        env = rendezvous.torchrun_env()
        if env is not None:
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            node_worker.run_rank(env.master_addr, env.master_port, env.rank, env.local_rank, per_node)
            return 0
        assert args is not None
        return node_worker.run_node(args.master_addr, args.master_port, args.nnodes, args.node_rank)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"paged-server worker: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C on this node: the engine reports the rank gone
        return 130


def _give_threads_to(thread: Any) -> None:
    """Leave the main thread (HTTP only) one torch thread and the engine
    thread all of them: a second OpenMP pool on the main thread makes every
    op of the engine's pay a wake-up."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    thread.call(lambda: torch.set_num_threads(threads))


def _run_serve(args: argparse.Namespace) -> int:
    from paged_server.entrypoints.openai.async_engine import EngineThread
    from paged_server.entrypoints.openai.engine_args import engine_config_from_args
    from paged_server.entrypoints.openai.frontend_args import lora_requests, settings_from_args
    from paged_server.entrypoints.openai.server import (
        bind_socket,
        build_engine,
        load_lora_modules,
        serve,
        served_model_name,
    )
    from paged_server.parallel.rendezvous import torchrun_env

    if (env := torchrun_env()) is not None and env.rank != 0:  # torchrun: rank 0 serves
        return _run_worker(None)

    if args.model_tag is not None:  # `serve MODEL`, as `vllm serve MODEL`
        if args.model is not None and args.model != args.model_tag:
            print(f"paged-server serve: model: given twice ({args.model_tag} and --model "
                  f"{args.model}); pass one", file=sys.stderr)
            return 2
        args.model = args.model_tag
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:
        config = engine_config_from_args(args)
        settings = settings_from_args(args, "", args.api_key)  # named once the model is known
    except (ValueError, OSError) as exc:
        print(f"paged-server serve: {exc}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logging.getLogger("paged_server").warning(
            "binding %s without --api-key: anyone who can reach this address can use the model",
            args.host,
        )
    from paged_server.parallel import WorkerStartError

    try:  # before the model loads: a busy port is known in a second, not minutes
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        print(f"paged-server serve: {_bind_error(args.host, args.port, exc)}", file=sys.stderr)
        return 2
    thread = EngineThread()  # loads the model and steps it: one torch thread pool
    _give_threads_to(thread)
    try:
        engine = build_engine(config, thread)
    except (ValueError, FileNotFoundError, WorkerStartError) as exc:  # bad model dir, setting, rank
        sock.close()
        print(f"paged-server serve: {exc}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as exc:
        sock.close()
        if not isinstance(exc, MemoryError) and "allocate" not in str(exc):
            raise
        print(f"paged-server serve: the KV cache or the model does not fit in memory "
              f"({str(exc).splitlines()[0][:200]}); lower --max-model-len or --max-batch-size, "
              "or size the cache with --num-gpu-blocks / --kv-cache-memory-bytes", file=sys.stderr)
        return 2
    try:  # --lora-modules: each adapter read and checked now, a bad one named at once
        load_lora_modules(engine, lora_requests(args.lora_modules), thread)
    except ValueError as exc:
        sock.close()
        engine.shutdown()
        print(f"paged-server serve: --lora-modules: {exc}", file=sys.stderr)
        return 2
    names = args.served_model_name or []
    settings.model_name = served_model_name(config, names[0] if names else None)
    settings.model_aliases = tuple(names[1:])  # vLLM: every name is accepted
    serve(engine, settings, sock, args.log_level, thread)
    return 0


def _bind_error(host: str, port: int, exc: OSError) -> str:
    """One line on why ``host:port`` cannot be listened on, and what to do."""
    if isinstance(exc, socket.gaierror):
        return (f"--host {host}: cannot resolve it ({exc.strerror}); pass an IP address such as "
                "127.0.0.1 or 0.0.0.0, or a name this machine resolves")
    if exc.errno == errno.EADDRINUSE:
        return (f"--port {port}: {host}:{port} is already in use; stop what listens there or "
                "pick another port (--port 0: any free one)")
    return f"--host {host} --port {port}: cannot listen there: {exc.strerror or exc}"


def _run_bench_serve(args: argparse.Namespace) -> int:
    from paged_server.bench.serving import bench_serve
    from paged_server.entrypoints.openai.engine_args import engine_config_from_args

    try:
        config = None if args.url else engine_config_from_args(args)
    except ValueError as exc:
        print(f"paged-server bench-serve: {exc}", file=sys.stderr)
        return 2
    report = bench_serve(args, config)
    line = json.dumps(report, default=str)
    print(line, flush=True)
    if args.output:
        with open(args.output, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    return 0 if report["failed"] == 0 else 1


def _run_bench(argv: list[str]) -> int:
    try:
        from paged_server.bench import main as bench_main
    except ImportError:
        print("paged-server bench: the offline benchmark (paged_server.bench) is not built "
              "in this install; use 'paged-server bench-serve' for the HTTP benchmark", file=sys.stderr)
        return 2
    return int(bench_main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = HintingParser(
        prog="paged-server", description="PagedAttention LLM server with an OpenAI-compatible API."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_bench_serve(sub)
    _add_worker(sub)
    sub.add_parser("bench", help="offline engine benchmark (paged_server.bench); "
                   "'paged-server bench --help' for its flags", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``paged-server`` script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # the bench CLI parses its own flags
        return _run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(getattr(args, "log_level", "info")).upper(), logging.INFO),
        format="%(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise
    if args.command == "serve":
        return _run_serve(args)
    if args.command == "worker":
        return _run_worker(args)
    return _run_bench_serve(args)


if __name__ == "__main__":
    raise SystemExit(main())
