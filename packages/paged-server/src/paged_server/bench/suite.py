"""Run one workload through every configuration, side by side, in one process.

Configurations: our engine with the ``paged`` and the ``contiguous`` KV
backend at the same KV bytes, transformers' continuous batching
(``hf_generate_batch``) with the same KV token budget, and transformers'
static ``generate`` in batches of 8 (``hf_static_generate``). The model is
loaded once per side and shared by the configurations of that side.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from paged_server.bench.engine_bench import KVBudget, engine_config, run_engine
from paged_server.bench.results import RunResult
from paged_server.bench.workloads import Workload

ENGINE_CONFIGS = ("paged", "contiguous")
HF_CONFIGS = ("hf_generate_batch", "hf_static_generate")
ALL_CONFIGS = ENGINE_CONFIGS + HF_CONFIGS


@dataclass(slots=True)
class SuiteOptions:
    """Knobs shared by every configuration of one run."""

    budget: KVBudget = field(default_factory=KVBudget)
    paged_max_batch_size: int = 256
    max_num_batched_tokens: int = 2048
    attention_backend: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # 8-bit: the same bytes as the model-dtype budget
    seed: int = 0
    static_batch_size: int = 8
    # A compiled engine's linear layers timed by torch's profiler (slows the run).
    profile_linears: bool = False


def log(msg: str) -> None:
    """Progress to stderr (stdout carries only JSON lines)."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


class ModelCache:
    """Loads the model once for our engine and once for transformers."""

    def __init__(self, model_dir: str, options: SuiteOptions) -> None:
        self.model_dir = model_dir
        self.options = options
        self._ours: Any = None
        self._hf: Any = None

    def _device_dtype(self) -> tuple[Any, Any]:
        from paged_server.models.loader import read_model_config

        cfg = engine_config(
            "paged", self.options.budget, model=self.model_dir, dtype=self.options.dtype
        )
        run = cfg.resolve(read_model_config(self.model_dir))
        return run.torch_device, run.torch_dtype

    def ours(self) -> Any:
        """Our loader's ``LoadedModel`` (shared by the paged and contiguous engines)."""
        if self._ours is None:
            from paged_server.models import load_model

            device, dtype = self._device_dtype()
            self._ours = load_model(self.model_dir, dtype, device)
        return self._ours

    def hf(self) -> Any:
        """The same checkpoint through transformers, same dtype."""
        if self._hf is None:
            from paged_server.bench.hf_baseline import load_hf_model

            self._hf = load_hf_model(self.model_dir, self._device_dtype()[1])
        return self._hf


def in_worker_thread(fn: Callable[[], RunResult]) -> RunResult:
    """Run ``fn`` on a fresh thread and return its result (or raise its error).

    transformers' continuous batching always generates on its own thread, and
    a server runs our engine on one too; running every configuration from a
    fresh thread gives them all the same torch/OpenMP threading state (which
    differs between the main thread and others), so their timings compare."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="paged-bench")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]  # type: ignore[no-any-return]


def run_config(
    name: str,
    workload: Workload,
    models: ModelCache,
    options: SuiteOptions,
    *,
    model_name: str,
    max_batch_size: int | None = None,
    enable_prefix_caching: bool = True,
    label: str | None = None,
) -> RunResult:
    """Run one named configuration on ``workload`` (on a worker thread, see
    ``in_worker_thread``; model loading stays on the caller's thread)."""
    label = label or name
    log(
        f"{workload.name}: {label} ({len(workload.requests)} requests, {workload.output_tokens} output tokens)"
    )
    if name in ENGINE_CONFIGS:
        from paged_server.engine.core.llm_engine import LLMEngine

        batch = max_batch_size
        if batch is None and name == "paged":
            batch = options.paged_max_batch_size
        cfg = engine_config(
            name,
            options.budget,
            model=models.model_dir,
            max_batch_size=batch,
            max_num_batched_tokens=options.max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            attention_backend=options.attention_backend,
            dtype=options.dtype,
            seed=options.seed,
            kv_cache_dtype=options.kv_cache_dtype,
            model_config=models.ours().config,
        )
        engine = LLMEngine(cfg, loaded=models.ours())
        try:
            result = in_worker_thread(
                lambda: run_engine(
                    engine, workload, config_name=label, model_name=model_name,
                    profile_linears=options.profile_linears,
                )  # fmt: skip
            )
        finally:
            del engine
            gc.collect()
        return result
    from paged_server.bench.hf_baseline import run_hf_continuous, run_hf_static

    hf = models.hf()
    if name == "hf_generate_batch":
        return in_worker_thread(
            lambda: run_hf_continuous(
                hf,
                workload,
                kv_tokens=options.budget.tokens,
                max_batch_size=max_batch_size or options.paged_max_batch_size,
                max_batched_tokens=options.max_num_batched_tokens,
                page_size=options.budget.block_size,
                model_name=model_name,
            )
        )
    if name == "hf_static_generate":
        return in_worker_thread(
            lambda: run_hf_static(
                hf, workload, batch_size=options.static_batch_size, model_name=model_name
            )
        )
    raise ValueError(f"unknown configuration {name!r}; choose from {', '.join(ALL_CONFIGS)}")


def ratios(results: Sequence[RunResult], of: str = "paged") -> dict[str, Any]:
    """Throughput of ``of`` divided by every other configuration's, same run."""
    by_name = {r.config: r for r in results}
    if of not in by_name:
        return {}
    base = by_name[of].tokens_per_s
    out = {
        f"{of}_vs_{name}": round(base / r.tokens_per_s, 3)
        for name, r in by_name.items()
        if name != of and r.tokens_per_s > 0
    }
    return out


def run_suite(
    workload: Workload,
    configs: Sequence[str],
    models: ModelCache,
    options: SuiteOptions,
    *,
    model_name: str,
    emit: Callable[[RunResult], None] | None = None,
) -> list[RunResult]:
    """Every configuration in ``configs`` on ``workload``; ``emit`` sees each
    result as soon as it is measured."""
    results = []
    for name in configs:
        result = run_config(name, workload, models, options, model_name=model_name)
        if emit is not None:
            emit(result)
        results.append(result)
    return results
