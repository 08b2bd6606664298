"""What ``tensor_parallel_size`` and ``pipeline_parallel_size`` need, checked
before any worker process starts.

A size the model cannot be split by, or one the machine has no devices for,
fails here in one line: started first, every rank would fail the same way
(one traceback each), and a size like 1000 would fork until memory ran out.
The model check builds the model's rank-0 shard on the meta device, so it
runs the model code's own divisibility checks (and the stages' layer split)
without reading a weight.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from paged_server.models.config import ModelConfig
from paged_server.models.loader import read_config_json
from paged_server.models.pipeline_parallel import PipelineStage, stage_layers
from paged_server.models.registry import resolve_architecture
from paged_server.models.tensor_parallel import TensorParallel
from paged_server.platform import platform_for

GUARD_HINT = (
    'code that creates LLM(...) must run from a file, under `if __name__ == "__main__":` '
    "(spawn, which starts the workers, imports the main module again in each)"
)


def check_tensor_parallel(
    world_size: int, model_path: str, device: torch.device, local_ranks: int | None = None,
    pipeline_parallel_size: int = 1,
) -> None:  # fmt: skip
    """Raise ``ValueError`` (one line) when ``world_size`` tensor-parallel
    ranks in each of ``pipeline_parallel_size`` stages cannot run
    ``model_path`` on ``device`` (``local_ranks`` of them on this node: all
    by default), or ``RuntimeError`` when this process's main module cannot
    be imported by a spawned worker."""
    check_model_splits(world_size, model_path, pipeline_parallel_size)
    local = world_size * pipeline_parallel_size if local_ranks is None else local_ranks
    check_devices(local, device, busy=min(local, world_size))
    check_spawnable_main()


def check_model_splits(world_size: int, model_path: str, pipeline_parallel_size: int = 1) -> None:
    """The heads, KV heads and MLP of ``model_path`` divide over ``world_size``
    ranks, and its layers over ``pipeline_parallel_size`` stages."""
    hf = read_config_json(Path(model_path).expanduser())
    arch_name, arch = resolve_architecture(hf)
    config = ModelConfig.from_hf(arch.text_config(hf), arch_name)
    stage = PipelineStage(0, pipeline_parallel_size)
    with torch.device("meta"):  # shapes only: no memory, no weights read
        arch.model_class(config, TensorParallel(0, world_size), stage)
    for rank in range(pipeline_parallel_size):
        stage_layers(config.num_layers, rank, pipeline_parallel_size)


def check_devices(world_size: int, device: torch.device, busy: int | None = None) -> None:
    """One GPU per rank on CUDA; on CPU one core per rank of a stage
    (``busy``: one stage's ranks with pipeline parallelism), whose
    all-reduces need every one running; stages, whose micro-batches only
    wait on the stage before, may time-slice the same cores."""
    platform_for(device).check_ranks(world_size, device, busy)


def main_module_imported_by_spawn() -> bool:
    """Whether spawn imports this process's main module again in each worker
    (by name after ``python -m``, from its file after ``python script.py``;
    not for an interactive session or ``python -c``)."""
    main = sys.modules.get("__main__")
    by_name = getattr(getattr(main, "__spec__", None), "name", None) is not None
    return by_name or getattr(main, "__file__", None) is not None


def check_spawnable_main() -> None:
    """Spawn runs the main module again in each worker, from its file: a
    script read from standard input (``python - < script.py``) has none."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return  # python -m: imported by name
    path = getattr(main, "__file__", None)
    if path is not None and not os.path.isfile(path):
        raise RuntimeError(
            f"tensor_parallel_size > 1 cannot start its workers from a script read from {path}: "
            + GUARD_HINT
        )
