"""Where a benchmark ran: date, hardware, library versions (for the results page)."""

from __future__ import annotations

import datetime as _dt
import os
import platform
from typing import Any


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _worker_thread_count() -> int:
    """Intra-op threads torch uses on a fresh thread, where every benchmark
    configuration runs (OpenMP's default there, whatever the main thread set)."""
    import threading

    import torch

    box: list[int] = []
    t = threading.Thread(target=lambda: box.append(torch.get_num_threads()))
    t.start()
    t.join()
    return box[0]


def describe_environment() -> dict[str, Any]:
    """A JSON-able description of this machine and run."""
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "kind": "environment",
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_name(),
        "cpu_cores": os.cpu_count(),
        "gpu": gpu,
        "hardware": gpu or f"CPU: {_cpu_name()} ({os.cpu_count()} cores)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": _worker_thread_count(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }
