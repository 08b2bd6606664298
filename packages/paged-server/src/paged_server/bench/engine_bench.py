"""Our engine on a workload: one burst, step until done, measure.

Every request arrives at t=0 (``add_request`` for all, then ``step()`` in a
loop), decodes greedily with EOS ignored, so the token count is fixed by the
workload. After every step we note the time, the running/waiting counts and
the pool's occupancy, which gives TTFT, inter-token latency, peak running
sequences, KV usage over time and preemptions.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from paged_server.bench.results import RunResult, TokenTimes, workload_result
from paged_server.bench.workloads import Workload


@dataclass(slots=True)
class KVBudget:
    """The KV memory both backends get: ``rows`` x ``max_model_len`` token
    slots (the contiguous baseline's shape; the paged pool gets the same
    tokens as ``rows * max_model_len / block_size`` blocks)."""

    rows: int = 8
    max_model_len: int = 4096
    block_size: int = 16

    @property
    def tokens(self) -> int:
        return self.rows * self.max_model_len

    @property
    def num_blocks(self) -> int:
        return self.tokens // self.block_size


@contextlib.contextmanager
def allow_rows_past_positions() -> Iterator[None]:
    """Within the block, let ``KVBudget``'s rows (the contiguous baseline's
    shape, 8 x 4,096 token slots by default, as ``max_model_len``) pass a
    model's shorter ``max_position_embeddings`` (the embedded model's 2,048):
    they size the KV memory every configuration gets, and the benchmark
    measures speed and memory on random weights, not output quality. Without
    it ``EngineConfig`` refuses them, as vLLM does. The variable is put back
    after, so a caller in the same process (a test) keeps the refusal."""
    from paged_server.config import ALLOW_LONG_MAX_MODEL_LEN_ENV

    before = os.environ.get(ALLOW_LONG_MAX_MODEL_LEN_ENV)
    os.environ[ALLOW_LONG_MAX_MODEL_LEN_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ALLOW_LONG_MAX_MODEL_LEN_ENV]
        else:
            os.environ[ALLOW_LONG_MAX_MODEL_LEN_ENV] = before


def engine_config(
    backend: str,
    budget: KVBudget,
    *,
    model: str | None,
    max_batch_size: int | None = None,
    max_num_batched_tokens: int = 2048,
    enable_prefix_caching: bool = True,
    attention_backend: str = "auto",
    dtype: str = "auto",
    seed: int = 0,
    kv_cache_dtype: str = "auto",
    model_config: Any = None,
) -> Any:
    """The ``EngineConfig`` for one backend at the given KV budget.

    contiguous: ``budget.rows`` rows of ``budget.max_model_len`` (its batch size
    *is* its memory). paged: the same tokens as blocks, and a batch limit of
    ``max_batch_size`` (default 256) that memory, not rows, bounds. With an
    8-bit ``kv_cache_dtype`` both get the *bytes* of that budget at the
    model's dtype (``model_config`` gives the shape), so about twice the tokens."""
    from paged_server.config import EngineConfig

    if backend == "contiguous":
        batch = budget.rows if max_batch_size is None else max_batch_size
        blocks = None
    elif backend == "paged":
        batch = 256 if max_batch_size is None else max_batch_size
        blocks = budget.num_blocks
    else:
        raise ValueError(f"backend must be 'paged' or 'contiguous', got {backend!r}")
    memory = None
    if kv_cache_dtype != "auto":
        if model_config is None:
            raise ValueError("an 8-bit kv_cache_dtype needs model_config to size the budget in bytes")
        from paged_ref.kv_quant import kv_bytes_per_token

        probe = EngineConfig(dtype=dtype)
        model_dtype = probe.resolve(model_config).torch_dtype
        shape = (model_config.num_layers, model_config.num_kv_heads, model_config.head_dim)
        memory = budget.tokens * kv_bytes_per_token(*shape, model_dtype)
        blocks = None
        if backend == "contiguous" and max_batch_size is None:
            batch = 4 * budget.rows  # room for the rows the bytes now hold (4x from float32)
    cfg = EngineConfig(
        model=model,
        kv_cache_backend=backend,
        block_size=budget.block_size,
        num_gpu_blocks=blocks,
        kv_cache_memory_bytes=memory,
        kv_cache_dtype=kv_cache_dtype,
        max_batch_size=batch,
        max_num_batched_tokens=max(max_num_batched_tokens, batch),
        max_model_len=budget.max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        attention_backend=attention_backend,
        dtype=dtype,
        max_queue_len=1 << 20,
        seed=seed,
    )
    cfg.validate()
    return cfg


def kv_occupancy(stats: dict[str, float]) -> tuple[float, float, float]:
    """``(tokens held, token slots allocated to sequences, pool token slots)``
    from a pool's ``stats()``: block counters for the paged pool, row
    counters for the contiguous one (a used row allocates ``max_model_len``).
    Tokens in shared blocks count once per sequence here; see
    ``physical_tokens_held`` for the paged pool."""
    held = stats.get("tokens_used", stats.get("tokens_held", 0.0))
    if "blocks_used" in stats:
        bs = stats["block_size"]
        return held, stats["blocks_used"] * bs, stats["num_blocks"] * bs
    per_row = stats["token_capacity"] / max(1.0, stats["rows_total"])
    return held, stats["rows_used"] * per_row, stats["token_capacity"]


def physical_tokens_held(block_manager: Any) -> int:
    """Token positions actually filled in allocated blocks, each block counted
    once however many sequences share it (prefix hits, forks)."""
    bs = block_manager.block_size
    filled: dict[int, int] = {}
    for seq_id in block_manager.seq_ids():
        n = block_manager.num_tokens(seq_id)
        for i, block in enumerate(block_manager.block_table(seq_id)):
            filled[block] = max(filled.get(block, 0), min(bs, max(0, n - i * bs)))
    return sum(filled.values())


def pool_occupancy(pool: Any) -> tuple[float, float, float]:
    """``kv_occupancy`` of the pool, with physical tokens for a block pool
    once blocks may be shared (the walk over page tables is skipped while no
    prefix hit or fork has happened, to keep the measured loop lean)."""
    stats = pool.stats()
    held, allocated, capacity = kv_occupancy(stats)
    manager = getattr(pool, "block_manager", None)
    if manager is not None and (stats.get("prefix_hits_tokens", 0) or stats.get("forks", 0)):
        held = float(physical_tokens_held(manager))
    return held, allocated, capacity


class LinearTimer:
    """Wall time spent inside a model's ``nn.Linear`` layers while active
    (forward hooks around each call). On a CPU the linear layers are the
    bound of a decoding engine: the matrix products any engine must run.
    Not for CUDA (kernels run asynchronously; timing them needs syncs), nor
    for a compiled forward (its graph calls no module, so no hook fires)."""

    def __init__(self, model: Any) -> None:
        import torch

        self.seconds = 0.0
        self._linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        self._handles: list[Any] = []
        self._start = 0.0

    def __enter__(self) -> LinearTimer:
        def before(*_: Any) -> None:
            self._start = time.perf_counter()

        def after(*_: Any) -> None:
            self.seconds += time.perf_counter() - self._start

        for m in self._linears:
            self._handles.append(m.register_forward_pre_hook(before))
            self._handles.append(m.register_forward_hook(after))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class ProfiledLinearTimer:
    """``LinearTimer`` for a compiled forward on a CPU, where no module hook
    fires: torch's profiler records the GEMM ops the graph calls (oneDNN's
    packed linears, aten's matmuls and weight-only kernels), and ``seconds``
    is their self time, taken on the thread that steps (its intra-op workers
    run inside). The profiler's own cost per op counts as wall time, not
    linear time, so the share it gives is a floor. GEMMs that inductor
    generates itself (int8/int4 weights, ``_gemm_template_options``) are not
    separate ops: no share for quantized engines."""

    GEMM_OPS = frozenset({
        "mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear",
        "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu",
    })  # fmt: skip

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.seconds = 0.0
        self._profile = profile(activities=[ProfilerActivity.CPU])

    def __enter__(self) -> ProfiledLinearTimer:
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._profile.__exit__(*exc)
        events = self._profile.key_averages()
        self.seconds = sum(e.self_cpu_time_total for e in events if e.key in self.GEMM_OPS) / 1e6


def _linear_timer(engine: Any, profile: bool) -> LinearTimer | ProfiledLinearTimer | None:
    """How this engine's time in its linear layers is measured: hooks when
    eager; when compiled with dense weights, the profiler if ``profile``
    (it slows the run); else, on a GPU, or for a compiled quantized model,
    not at all."""
    from paged_server.models.quantization.linear import uses_packed_cpu_kernels

    model = engine.loaded.model
    if next(model.parameters()).device.type != "cpu":
        return None
    if engine.worker.compiled is None:
        return LinearTimer(model)
    return ProfiledLinearTimer() if profile and not uses_packed_cpu_kernels(model) else None


def _greedy(max_tokens: int) -> Any:
    from paged_server.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_engine(
    engine: Any,
    workload: Workload,
    *,
    config_name: str,
    model_name: str = "",
    profile_linears: bool = False,
) -> RunResult:
    """Run ``workload`` to completion on ``engine`` (fresh, idle) and measure
    it (``profile_linears``: see ``_linear_timer``)."""
    pool = engine.kv_manager
    for r in workload.warmup:  # untimed; only the burst below is measured
        engine.add_request(r.request_id, list(r.prompt_token_ids), _greedy(r.max_tokens))
    while engine.has_unfinished():
        engine.step()
    before = engine.metrics()
    timeline: list[dict[str, float]] = []
    produced = 0
    start = time.perf_counter()
    clock = TokenTimes(start)
    for r in workload.requests:
        engine.add_request(r.request_id, list(r.prompt_token_ids), _greedy(r.max_tokens))
    peak_held = (0.0, 1.0)
    peak_pool = 0.0
    peak_running = 0
    timer = _linear_timer(engine, profile_linears)
    with timer if timer is not None else contextlib.nullcontext():
        while engine.has_unfinished():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                if out.finish_reason == "error":
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                if out.new_token_ids:
                    clock.record(out.request_id, len(out.new_token_ids), now)
                    produced += len(out.new_token_ids)
            m = engine.metrics()
            held, allocated, capacity = pool_occupancy(pool)
            running = int(m["num_requests_running"])
            peak_running = max(peak_running, running)
            peak_pool = max(peak_pool, allocated / capacity if capacity else 0.0)
            if held > peak_held[0]:
                peak_held = (held, allocated)
            timeline.append(
                {
                    "t": round(now - start, 4),
                    "running": running,
                    "waiting": int(m["num_requests_waiting"]),
                    "tokens_held": held,
                    "slots_allocated": allocated,
                    "pool_usage": round(allocated / capacity, 4) if capacity else 0.0,
                }
            )
        seconds = time.perf_counter() - start
    after = engine.metrics()
    queries = after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"]
    hits = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
    cfg = engine.config
    return workload_result(
        "engine",
        config_name,
        workload,
        model_name,
        produced,
        seconds,
        clock,
        peak_running=peak_running,
        peak_kv_usage=peak_held[0] / peak_held[1] if peak_held[1] else None,
        peak_kv_pool_usage=peak_pool,
        preemptions=int(after["num_preemptions_total"] - before["num_preemptions_total"]),
        prefix_cache_hit_rate=hits / queries if queries else None,
        linear_seconds=timer.seconds if timer is not None else None,
        settings={
            "kv_cache_backend": cfg.kv_cache_backend,
            "max_batch_size": cfg.max_batch_size,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "max_model_len": cfg.max_model_len,
            "block_size": cfg.block_size,
            "kv_capacity_tokens": int(after["kv_capacity_tokens"]),
            "kv_bytes": int(engine.worker.tensors.kv_bytes()),
            "enable_prefix_caching": cfg.enable_prefix_caching,
            "enable_chunked_prefill": cfg.enable_chunked_prefill,
            "steps": len(timeline),
        },
        timeline=timeline,
    )
