"""Where a decode step's time goes, from torch.profiler: for the GPU run
(``gpu_serving.py``'s ``llm`` phase) on a few pure-decode steps, the wall
time per step against the time the device spent in kernels, and the kernels
that took it. A step whose kernels fill its wall time is bound by them (then
the top kernels say which); one with the device idle half the time is bound
by the host or by launches.

On a CPU (the tiny dry run) there are no device kernels: the top rows are
the host's own ops, so the script's path is checked, not a GPU's numbers.
"""

from __future__ import annotations

import time
from typing import Any

import torch

TOP = 12  # kernels kept per profile


def profile_decode_steps(engine: Any, prompts: list[list[int]], steps: int, tag: str) -> dict[str, Any]:
    """Run ``prompts`` (prefix hits by now) until every stream decodes, then
    profile ``steps`` steps; the rest of each request is drained unprofiled."""
    from torch.profiler import ProfilerActivity, profile

    from paged_server.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for n, ids in enumerate(prompts):
        engine.add_request(f"profile{tag}-{n}", ids, params)
    for _ in range(3):  # the prompts' last tokens, then decode with async scheduling settled
        engine.step()
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return summarize(prof, steps, wall, cuda)


def summarize(prof: Any, steps: int, wall_s: float, cuda: bool) -> dict[str, Any]:
    """Per step: wall ms, device-kernel ms and launches, and the top kernels."""
    from torch.autograd import DeviceType

    rows = []
    for e in prof.key_averages():
        on_device = e.device_type == DeviceType.CUDA
        if on_device != cuda:
            continue
        ms = (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3
        rows.append({"name": e.key[:100], "ms_per_step": ms / steps, "calls_per_step": e.count / steps})
    rows.sort(key=lambda r: -r["ms_per_step"])
    busy = sum(r["ms_per_step"] for r in rows) if cuda else None
    wall_ms = wall_s * 1e3 / steps
    return {
        "steps": steps,
        "wall_ms_per_step": wall_ms,
        "kernel_ms_per_step": busy,
        "kernels_per_step": sum(r["calls_per_step"] for r in rows) if cuda else None,
        "device_busy_fraction": busy / wall_ms if busy is not None else None,
        "top": rows[:TOP],
    }
