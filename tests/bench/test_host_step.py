"""``benchmarks/host_step.py`` measures what its critical path claims: each
timed step holds a device window (the forward's launch to the sampler's
first wait for the device) inside it, the critical path is the step less
that window, and the sampler is left as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paged_server.engine.sample import sampler


@pytest.mark.parametrize("async_output_proc", [False, True])
def test_the_critical_path_is_each_step_less_its_device_window(
    tiny_model_dir: Path, async_output_proc: bool
) -> None:
    import host_step
    threads, row_max = torch.get_num_threads(), sampler.row_max
    argv = ["--model", str(tiny_model_dir), "--seqs", "4", "--context", "48", "--steps", "6"]
    try:
        result = host_step.main(argv + ["--async-output-proc"] * async_output_proc)
    finally:
        torch.set_num_threads(threads)  # main() sets its own
    assert sampler.row_max is row_max
    assert result["async_output_proc"] is async_output_proc
    assert result["greedy_max_ms_per_step_median"] > 0  # the window closed after the max
    assert 0 < result["critical_ms_per_step_median"] < result["host_ms_per_step_median"]
