"""Running the app under uvicorn: in the foreground (``paged-server serve``) or
on a background thread bound to a free loopback port (tests, ``bench-serve``).

uvicorn handles SIGINT/SIGTERM in the foreground: it stops accepting, lets
in-flight requests finish for up to ``shutdown_timeout_s``, cancels the rest
(which aborts them in the engine), then the app's lifespan stops the engine
thread.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from paged_server.config import EngineConfig
from paged_server.entrypoints.openai.app import ServerSettings, create_app
from paged_server.entrypoints.openai.async_engine import EngineLike, EngineThread
from paged_server.entrypoints.openai.read_timeout import with_read_timeout

logger = logging.getLogger("paged_server.entrypoints.openai")


def build_engine(config: EngineConfig, thread: EngineThread | None = None) -> Any:
    """Validate ``config`` and build the engine (loads the model) on ``thread``,
    the thread that will step it (pass the same one to ``serve`` /
    ``ServerThread``), or on the caller's. With ``data_parallel_size > 1``:
    that many replica processes behind one `DataParallelEngine`."""
    from paged_server.engine.core.llm_engine import LLMEngine

    config.validate()
    if config.data_parallel_size > 1:
        from paged_server.data_parallel import DataParallelEngine

        return DataParallelEngine(config)  # the replicas load the model, not this thread
    if thread is None:
        return LLMEngine(config)
    return thread.call(lambda: LLMEngine(config))


def load_lora_modules(engine: Any, loras: tuple[Any, ...], thread: EngineThread | None = None) -> None:
    """Serve the ``--lora-modules`` adapters (``LoRARequest``s) from the start,
    loaded on ``thread`` (the engine's); ``ValueError`` names a bad one."""
    if loras and not getattr(engine.config, "enable_lora", False):
        raise ValueError("serving LoRA adapters needs --enable-lora too")
    for lora in loras:
        if thread is None:
            engine.add_lora(lora)
        else:
            thread.call(lambda lora=lora: engine.add_lora(lora))


def served_model_name(config: EngineConfig, override: str | None = None) -> str:
    """The id clients send as ``model``: the override, the model directory's
    name, the Hugging Face id it was named by (as vLLM), or the embedded
    default model's name."""
    if override:
        return override
    if config.model:
        path = Path(config.model).expanduser()
        return path.resolve().name if path.is_dir() else config.model
    from paged_server.default_model import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME


def startup_line(engine: EngineLike, settings: ServerSettings, url: str) -> str:
    """One line an operator reads to know what is being served, how, and where."""
    config = engine.config
    m = engine.metrics()
    dtype = f"{config.dtype} ({config.dtype_reason})" if config.dtype_reason else config.dtype
    source = config.model or "embedded default model"
    tokens = int(m.get("kv_capacity_tokens", 0))
    if config.kv_cache_backend == "contiguous":
        layout = f"{tokens // config.max_model_len} rows of {config.max_model_len}"
    else:
        layout = f"{int(m.get('kv_capacity_blocks', 0))} blocks of {config.block_size}"
    how = engine.capacity.sized_by
    sized_by = f" (sized by {how})" if how else ""
    return (
        f"paged-server: serving '{settings.model_name}' ({source}) on {url} | "
        f"dtype={dtype} kv_cache_backend={config.kv_cache_backend} attention={config.attention_backend} | "
        f"KV cache {_dtype_name(engine.capacity.kv_dtype)} "
        f"(kv_cache_dtype={config.kv_cache_dtype}"
        f"{', calculated scales' if config.calculate_kv_scales else ''}): "
        f"capacity {tokens} tokens in {layout}"
        f"{sized_by} | "
        f"max_model_len={config.max_model_len} max_batch_size={config.max_batch_size} "
        f"api_key={'on' if settings.api_key else 'off'}"
        + (f" | {parallel}" if (parallel := engine.parallel_summary()) else "")
    )


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0 = a free port chosen by the OS)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket, scheme: str = "http") -> str:
    host, port = sock.getsockname()[:2]
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _uvicorn_config(app: Any, settings: ServerSettings, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=max(1, int(settings.shutdown_timeout_s)),
        # h11 always (not httptools when installed), bounded against slowloris clients
        http=with_read_timeout(settings.request_read_timeout_s),
        timeout_keep_alive=settings.timeout_keep_alive_s,
        access_log=log_level in ("debug", "trace"),
        root_path=settings.root_path,
        ssl_keyfile=settings.ssl_keyfile,
        ssl_certfile=settings.ssl_certfile,
        ssl_ca_certs=settings.ssl_ca_certs,
    )


def serve(
    engine: Any,
    settings: ServerSettings,
    sock: socket.socket,
    log_level: str = "info",
    thread: EngineThread | None = None,
) -> None:
    """Serve on ``sock`` (from ``bind_socket``, bound before the model loaded)
    until SIGINT/SIGTERM (foreground; blocks); ``thread`` steps the engine
    (the one ``build_engine`` built it on)."""
    app = create_app(engine, settings, thread)
    scheme = "https" if settings.ssl_certfile else "http"
    print(startup_line(engine, settings, _url(sock, scheme)), file=sys.stderr, flush=True)
    uvicorn.Server(_uvicorn_config(app, settings, log_level)).run(sockets=[sock])


class ServerThread:
    """The app served by uvicorn on a background thread (loopback, free port).

    ``with ServerThread(engine, settings) as server: server.url`` -- the
    engine is the same object tests can audit directly. ``thread``: the
    `EngineThread` the engine was built on (``build_engine``), which steps it.
    """

    def __init__(
        self,
        engine: Any,
        settings: ServerSettings,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        thread: EngineThread | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.app = create_app(engine, settings, thread)
        self._sock = bind_socket(host, port)
        self.url = _url(self._sock, "https" if settings.ssl_certfile else "http")
        self._server = uvicorn.Server(_uvicorn_config(self.app, settings, log_level))
        self._thread = threading.Thread(target=self._run, name="paged-uvicorn", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as exc:  # surfaced by start()
            self._error = exc

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {self._error!r}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    @property
    def async_engine(self) -> Any:
        return self.app.state.async_engine

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
